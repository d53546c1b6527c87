"""Per-round JSON lines, a run summary, and the live one-line progress display.

Files in a metrics folder (read by notebooks/results.ipynb):
  rounds.jsonl   one object per round: round, prompt (index), t (s since that prompt began), k, accepted,
                 committed, draft_ms, predrafted (drafts made while the round before was on the wire, on the
                 full-acceptance guess or a runner-up branch, so draft_ms is only taking them), branches
                 (runner-up branches drafted while this round was out), ahead_ms (node 0's time drafting
                 ahead while it was out), stage_ms [per stage], draft_gpu_ms and stage_gpu_ms [per stage]
                 (the device's own time for them from CUDA events, without the host's share; null off CUDA),
                 network_ms (round - draft - stages), round_ms,
                 send_ms (stage 0 packs and sends), host_ms [per later stage: frame read -> compute],
                 wake_ms (verdict read -> node 0 acts), bytes_out, bytes_in
  summary.json   the last prompt's result (as `kit run --json` prints it) plus its round statistics
  prompts.jsonl  one such summary per prompt
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]


def summarize(rounds: list[dict]) -> dict:
    """Round statistics: acceptance by draft position, mean time of each part of a round, percentiles."""
    if not rounds:
        return {"rounds": 0}
    k_max = max(r["k"] for r in rounds)
    by_pos = []
    for j in range(1, k_max + 1):
        offered = [r for r in rounds if r["k"] >= j]
        by_pos.append(sum(r["accepted"] >= j for r in offered) / len(offered) if offered else 0.0)
    n_stages = max(len(r["stage_ms"]) for r in rounds)
    round_ms = [r["round_ms"] for r in rounds]
    return {
        "rounds": len(rounds),
        "tokens_per_round": sum(r["committed"] for r in rounds) / len(rounds),
        "mean_k": statistics.fmean(r["k"] for r in rounds),
        "acceptance_by_position": by_pos,
        "draft_ms": statistics.fmean(r["draft_ms"] for r in rounds),
        "stage_ms": [statistics.fmean(r["stage_ms"][i] for r in rounds if len(r["stage_ms"]) > i)
                     for i in range(n_stages)],
        "network_ms": statistics.fmean(r["network_ms"] for r in rounds),
        "round_ms": statistics.fmean(round_ms),
        "round_ms_p50": percentile(round_ms, 50),
        "round_ms_p90": percentile(round_ms, 90),
        "round_ms_p99": percentile(round_ms, 99),
        "bytes_out_per_round": statistics.fmean(r["bytes_out"] for r in rounds),
        "bytes_in_per_round": statistics.fmean(r["bytes_in"] for r in rounds),
    }


class MetricsWriter:
    """Write rounds as they finish (a crash keeps what was written) and the summary at the end; a new
    writer starts the folder's files afresh."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []  # this prompt's rounds
        self._file = open(self.folder / "rounds.jsonl", "w", buffering=1)
        (self.folder / "prompts.jsonl").write_text("")

    def start_prompt(self) -> None:
        self.rows = []

    def round(self, row: dict) -> None:
        self.rows.append(row)
        self._file.write(json.dumps(row) + "\n")

    def summary(self, result: dict, extra: dict | None = None) -> dict:
        doc = {**result, **summarize(self.rows), **(extra or {})}
        doc["rounds"] = result.get("rounds", doc.get("rounds"))
        path = self.folder / "summary.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(path)
        with open(self.folder / "prompts.jsonl", "a") as f:
            f.write(json.dumps(doc) + "\n")
        return doc

    def close(self) -> None:
        self._file.close()


class Progress:
    """One line, rewritten in place: tokens, tokens/s, tokens per round, last round time."""

    def __init__(self, stream=sys.stderr, every_s: float = 0.2):
        self.stream, self.every_s = stream, every_s
        self.start()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = self.rounds = 0
        self.shown = 0.0

    def update(self, row: dict) -> None:
        self.tokens += row["committed"]
        self.rounds += 1
        now = time.perf_counter()
        if now - self.shown >= self.every_s:
            self.shown = now
            rate = self.tokens / max(1e-9, now - self.t0)
            self.stream.write(f"\r[kit] {self.tokens} tokens  {rate:6.1f} tok/s  {self.tokens / self.rounds:4.2f} tok/round"
                              f"  round {row['round_ms']:6.1f} ms ")
            self.stream.flush()

    def done(self) -> None:
        if self.rounds:
            self.stream.write("\n")
            self.stream.flush()
