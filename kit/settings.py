"""Settings of the node notebooks, resolved without ever waiting for a click (DESIGN.md decision 6).

Each setting comes from the first place that has it: the papermill `parameters` cell, the environment
(KIT_<NAME>), Kaggle Secrets (a secret named KIT_<NAME>), the notebook's form (widgets), its default.
A relay card (the JSON `python -m relay.provision` writes) fills relay, token, fingerprint and session
when no place above gave them. What is still missing is named at once, so "Run All" fails fast instead of hanging.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

DEFAULT_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a short docstring.",
    "List three differences between TCP and UDP.",
]


@dataclass(frozen=True)
class Spec:
    name: str
    kind: type  # str, int, float, bool or list
    default: Any
    help: str
    required: bool = False
    stage0: bool = False  # only node 0 (the driver) uses it
    secret: bool = False  # never shown

    @property
    def env(self) -> str:
        return "KIT_" + self.name.upper()


SPECS = [
    Spec("relay_card", str, None, "relay card from `python -m relay.provision`: a path, or the JSON itself "
                                  "(relay, fingerprint, token and session in one)", secret=True),
    Spec("relay", str, None, "relay address HOST:PORT", required=True),
    Spec("token", str, None, "the relay's session token", required=True, secret=True),
    Spec("fingerprint", str, None, "SHA-256 fingerprint of the relay's TLS certificate (pinned; without it the "
                                   "link is plain TCP)"),
    Spec("session", str, "kit", "session name, the same on every node (default: the relay card's, else kit)"),
    Spec("stage", int, None, "this node's stage index (each notebook sets its own default)", required=True),
    Spec("stages", int, 2, "number of stages (nodes) in the ring"),
    Spec("target", str, "Qwen/Qwen2.5-7B-Instruct", "target model: hub id, checkpoint folder or .gguf file"),
    Spec("draft", str, "Qwen/Qwen2.5-0.5B-Instruct", "drafter: a model of the same tokenizer, self:L, ngram or none",
         stage0=True),
    Spec("k", int, 8, "draft tokens per round", stage0=True),
    Spec("max_new_tokens", int, 256, "tokens to generate per prompt", stage0=True),
    Spec("prompts", list, DEFAULT_PROMPTS, "prompts to run (a JSON list, or one prompt per line)", stage0=True),
    Spec("load_in_4bit", bool, False, "NF4 weights through bitsandbytes (e.g. a 14B target on 2x T4)"),
    Spec("cpu_test", bool, False, "CPU test mode: run without a GPU (CI, small models only)"),
    Spec("out", str, None, "folder for metrics, summary and logs (default: /kaggle/working, else ./kit-output)"),
    Spec("max_minutes", float, 60.0, "stop the node after this many minutes, whatever happens (saves GPU quota)"),
    Spec("extra_args", str, "", "more `python -m kit node` options, e.g. --depth 2 --adaptive-k"),
]
BY_NAME = {s.name: s for s in SPECS}
NAMES = [s.name for s in SPECS]
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


class SettingsError(ValueError):
    """A setting with a value of the wrong kind."""


class MissingSettings(RuntimeError):
    """Required settings that no source gave."""


def kaggle_secret(name: str) -> str | None:
    """A Kaggle Secret attached to this notebook, or None (not on Kaggle, not attached, any failure)."""
    try:
        from kaggle_secrets import UserSecretsClient
    except ImportError:
        return None
    try:
        return UserSecretsClient().get_secret(name) or None
    except Exception:
        return None


def parse(spec: Spec, value: Any, source: str) -> Any:
    """A value of the spec's kind; strings (environment, secrets, widgets) are parsed."""
    if value is None or spec.kind is str:
        return value if value is None else str(value)
    if spec.kind is list:
        if isinstance(value, (list, tuple)):
            return [str(v) for v in value]
        text = str(value).strip()
        if text.startswith("["):
            try:
                items = json.loads(text)
            except ValueError as e:
                raise SettingsError(f"{spec.name} ({source}) is not a JSON list: {e}") from None
            return [str(v) for v in items]
        return [line.strip() for line in text.splitlines() if line.strip()]
    if spec.kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).strip().lower() in TRUE | FALSE:
            return str(value).strip().lower() in TRUE
        raise SettingsError(f"{spec.name} ({source}) must be true or false, got {value!r}")
    try:
        return spec.kind(value)
    except (TypeError, ValueError):
        raise SettingsError(f"{spec.name} ({source}) must be a number, got {value!r}") from None


def read_card(value: str) -> dict:
    """A relay card given as JSON text or as a path to the JSON file."""
    text = value.strip()
    if not text.startswith("{"):
        try:
            text = Path(text).expanduser().read_text()
        except OSError as e:
            raise SettingsError(f"cannot read the relay card {value}: {e.strerror}") from None
    try:
        card = json.loads(text)
    except ValueError as e:
        raise SettingsError(f"the relay card is not JSON: {e}") from None
    if not isinstance(card, dict):
        raise SettingsError("the relay card must be a JSON object {relay, fingerprint, token}")
    return card


@dataclass
class Settings:
    values: dict[str, Any]
    sources: dict[str, str]
    missing: list[str] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def table(self) -> str:
        """One line per setting, secrets masked, with the place each came from."""
        lines = []
        for name, value in self.values.items():
            shown = "(missing)" if name in self.missing else value
            if BY_NAME[name].secret and value is not None:
                shown = "*" * 8
            shown = str(shown) if len(str(shown)) <= 60 else str(shown)[:57] + "..."
            lines.append(f"  {name:<15} {shown:<60}  ({self.sources[name]})")
        return "\n".join(lines)

    def require(self) -> None:
        """Stop here, naming every missing setting and where it can be given."""
        if not self.missing:
            return
        names = ", ".join(f"{n} ({BY_NAME[n].env})" for n in self.missing)
        raise MissingSettings(
            f"missing settings: {names}. Give each in the parameters cell, as an environment variable, "
            f"as a Kaggle Secret of that name (Add-ons > Secrets), or in the form above; or give a relay card "
            f"(KIT_RELAY_CARD) that holds relay, fingerprint and token.")


def resolve(params: Mapping[str, Any], *, defaults: Mapping[str, Any] | None = None,
            widgets: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
            secret: Callable[[str], str | None] = kaggle_secret, names: list[str] | None = None) -> Settings:
    """Resolve the settings; `params` is any mapping (a notebook passes its globals(): only setting names
    are read, None meaning "not given"); `defaults` overrides the built-in defaults (e.g. the stage)."""
    env = os.environ if env is None else env
    defaults = {**{s.name: s.default for s in SPECS}, **(defaults or {})}
    if defaults.get("out") is None:
        defaults["out"] = "/kaggle/working" if Path("/kaggle/working").is_dir() else "kit-output"
    widgets = widgets or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def pick(spec: Spec) -> tuple[Any, str]:
        if params.get(spec.name) is not None:
            return params[spec.name], "parameters"
        if env.get(spec.env):
            return env[spec.env], "environment"
        value = secret(spec.env)
        if value:
            return value, "Kaggle Secrets"
        if widgets.get(spec.name) not in (None, ""):
            return widgets[spec.name], "form"
        return defaults[spec.name], "default"

    stage = None
    for spec in SPECS:
        if names is not None and spec.name not in names:
            continue
        if spec.stage0 and stage not in (None, 0):
            continue  # node 0's generation settings mean nothing on the other stages
        raw, source = pick(spec)
        values[spec.name], sources[spec.name] = parse(spec, raw, source), source
        if spec.name == "stage":
            stage = values["stage"]
    if values.get("relay_card"):
        card = read_card(values["relay_card"])
        for name in ("relay", "token", "fingerprint", "session"):
            if name in values and sources[name] == "default" and card.get(name):
                values[name], sources[name] = card[name], "relay card"
    missing = [n for n, v in values.items() if v is None and BY_NAME[n].required]
    return Settings(values, sources, missing)
