#!/usr/bin/env bash
# Install or update the kit relay on a Linux VM (Amazon Linux, Ubuntu, Debian). Run as root.
# Idempotent: the TLS certificate and the session token are made once and kept on re-runs
# (unless --rotate-token); the relay is restarted so that newly uploaded code runs.
# Ends with KEY=VALUE lines on stdout (KIT_*) that relay/provision.py parses; progress goes to stderr.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: ec2_setup.sh [--port N] [--metrics-port N] [--rotate-token] [--src DIR] [--prefix DIR]

  --port N          TCP port the relay listens on (env KIT_RELAY_PORT, default 7000)
  --metrics-port N  also serve /healthz and /metrics on this port (env KIT_RELAY_METRICS_PORT;
                    default: none). Keep it closed in the security group.
  --rotate-token    replace the session token with a new one (env KIT_RELAY_ROTATE_TOKEN=1);
                    every notebook then needs the new relay card
  --src DIR         folder holding the relay/ package to install (env KIT_RELAY_SRC,
                    default: the folder of this script, then its parent)
  --prefix DIR      install under DIR instead of / (env KIT_RELAY_PREFIX), for tests and
                    side-by-side installs; a prefixed install runs detached, not under systemd
  -h, --help        show this help
EOF
}

log() { printf 'kit-relay setup: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

PORT="${KIT_RELAY_PORT:-7000}"
METRICS_PORT="${KIT_RELAY_METRICS_PORT:-}"
ROTATE="${KIT_RELAY_ROTATE_TOKEN:-0}"
SRC="${KIT_RELAY_SRC:-}"
PREFIX="${KIT_RELAY_PREFIX:-}"

while [ $# -gt 0 ]; do
    case "$1" in
        --port) PORT="${2:?--port needs a value}"; shift 2 ;;
        --metrics-port) METRICS_PORT="${2:?--metrics-port needs a value}"; shift 2 ;;
        --rotate-token) ROTATE=1; shift ;;
        --src) SRC="${2:?--src needs a value}"; shift 2 ;;
        --prefix) PREFIX="${2:?--prefix needs a value}"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done

is_port() { [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ] && [ "$1" -le 65535 ]; }
is_port "$PORT" || die "--port must be 1..65535, got '$PORT'"
[ -z "$METRICS_PORT" ] || is_port "$METRICS_PORT" || die "--metrics-port must be 1..65535, got '$METRICS_PORT'"
[ "$(id -u)" -eq 0 ] || die "run as root (sudo bash $0 ...)"
PREFIX="${PREFIX%/}"

if [ -z "$SRC" ]; then
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    if [ -f "$here/relay/server.py" ]; then SRC="$here"; else SRC="$(dirname "$here")"; fi
fi
[ -f "$SRC/relay/server.py" ] || die "no relay package at $SRC/relay (upload relay/*.py next to this script or pass --src)"

SVC_USER=kitrelay
UNIT=kit-relay
APP_DIR="$PREFIX/opt/kit-relay"
ETC_DIR="$PREFIX/etc/kit-relay"
LOG_DIR="$PREFIX/var/log/kit-relay"
RUN_DIR="$PREFIX/var/lib/kit-relay"
PID_FILE="$RUN_DIR/relay.pid"
LOG_FILE="$LOG_DIR/relay.log"
TOKEN_FILE="$ETC_DIR/token"
CERT="$ETC_DIR/cert.pem"
KEY="$ETC_DIR/key.pem"

install_packages() {
    if command -v dnf >/dev/null; then dnf install -y -q "$@" >&2
    elif command -v yum >/dev/null; then yum install -y -q "$@" >&2
    elif command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2
    else die "no dnf, yum or apt-get: install $* by hand and re-run"
    fi
}

# The system python3 first: one under a login's home (pyenv, conda) is not runnable by the service user.
find_python() {
    local p
    for p in /usr/bin/python3 /usr/local/bin/python3 "$(command -v python3 || true)"; do
        [ -n "$p" ] && [ -x "$p" ] && { echo "$p"; return 0; }
    done
    return 1
}

missing=()
find_python >/dev/null || missing+=(python3)
command -v openssl >/dev/null || missing+=(openssl)
command -v setpriv >/dev/null || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    install_packages "${missing[@]}"
fi
PYTHON="$(find_python)" || die "python3 is still missing after installing it"

if ! id "$SVC_USER" >/dev/null 2>&1; then
    log "creating system user $SVC_USER"
    useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$SVC_USER" 2>/dev/null \
        || useradd --system --no-create-home --home-dir /nonexistent --shell /sbin/nologin "$SVC_USER"
fi
as_service_user() { setpriv --reuid="$SVC_USER" --regid="$SVC_USER" --init-groups --no-new-privs "$@"; }
as_service_user "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 8))' \
    || die "$PYTHON ($("$PYTHON" -V 2>&1)) is too old or not runnable by $SVC_USER; the relay needs Python >= 3.8"

# Code: build the new package beside the old one, then swap, so a half copy never runs.
install -d -m 0755 "$APP_DIR" "$RUN_DIR"
install -d -m 0750 -o "$SVC_USER" -g "$SVC_USER" "$LOG_DIR"
install -d -m 0750 -o root -g "$SVC_USER" "$ETC_DIR"
rm -rf "$APP_DIR/relay.new" "$APP_DIR/relay.old"
install -d -m 0755 "$APP_DIR/relay.new"
for f in "$SRC"/relay/*.py; do
    [ "$(basename "$f")" = provision.py ] || install -m 0644 "$f" "$APP_DIR/relay.new/"
done
"$PYTHON" -m compileall -q "$APP_DIR/relay.new" >/dev/null \
    || die "the relay code does not compile with $("$PYTHON" -V 2>&1)"
if [ -d "$APP_DIR/relay" ]; then mv "$APP_DIR/relay" "$APP_DIR/relay.old"; fi
mv "$APP_DIR/relay.new" "$APP_DIR/relay"
rm -rf "$APP_DIR/relay.old"
(cd "$APP_DIR" && as_service_user "$PYTHON" -c 'import relay.server') || die "the relay code does not import with $("$PYTHON" -V 2>&1)"

# Certificate and token: made once, kept on re-runs.
if [ ! -s "$CERT" ] || [ ! -s "$KEY" ]; then
    log "generating a self-signed TLS certificate"
    (umask 077 && openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=kit-relay" \
        -keyout "$KEY.tmp" -out "$CERT.tmp" 2>/dev/null)
    mv "$KEY.tmp" "$KEY"
    mv "$CERT.tmp" "$CERT"
fi
chown "$SVC_USER:$SVC_USER" "$KEY"
chmod 0600 "$KEY"
chmod 0644 "$CERT"

if [ ! -s "$TOKEN_FILE" ] || [ "$ROTATE" = 1 ]; then
    if [ -s "$TOKEN_FILE" ]; then log "rotating the session token"; else log "generating the session token"; fi
    (umask 077 && openssl rand -hex 32 >"$TOKEN_FILE.tmp")
    mv "$TOKEN_FILE.tmp" "$TOKEN_FILE"
fi
chown "$SVC_USER:$SVC_USER" "$TOKEN_FILE"
chmod 0600 "$TOKEN_FILE"

ARGS=(--port "$PORT" --token-file "$TOKEN_FILE" --cert "$CERT" --key "$KEY")
[ -z "$METRICS_PORT" ] || ARGS+=(--metrics-port "$METRICS_PORT")

# A relay we started detached, alive (a zombie has no command line, so it does not count).
is_relay() { [[ "$1" =~ ^[0-9]+$ ]] && grep -qa relay "/proc/$1/cmdline" 2>/dev/null; }

stop_detached() {
    [ -s "$PID_FILE" ] || return 0
    local pid
    pid="$(cat "$PID_FILE")"
    if is_relay "$pid"; then
        log "stopping the running relay (pid $pid)"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do is_relay "$pid" || break; sleep 0.1; done
        if is_relay "$pid"; then kill -9 "$pid" 2>/dev/null || true; fi
    fi
    rm -f "$PID_FILE"
}

# Wait until the relay accepts TCP connections on the loopback address.
wait_listening() {
    "$PYTHON" - "$PORT" <<'EOF'
import socket, sys, time
deadline = time.monotonic() + 15
while True:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.2)
EOF
}

open_firewall() {
    if command -v ufw >/dev/null && ufw status 2>/dev/null | grep -q '^Status: active'; then
        log "opening $PORT/tcp in ufw"
        ufw allow "$PORT/tcp" >&2
    fi
    if command -v firewall-cmd >/dev/null && firewall-cmd --state >/dev/null 2>&1; then
        log "opening $PORT/tcp in firewalld"
        firewall-cmd --quiet --permanent --add-port="$PORT/tcp"
        firewall-cmd --quiet --reload
    fi
}

if [ -z "$PREFIX" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
    MODE=systemd
    stop_detached
    caps=""
    if [ "$PORT" -lt 1024 ] || { [ -n "$METRICS_PORT" ] && [ "$METRICS_PORT" -lt 1024 ]; }; then
        caps="CAP_NET_BIND_SERVICE"
    fi
    cat >"/etc/systemd/system/$UNIT.service.tmp" <<EOF
[Unit]
Description=kit relay (joins the kit's notebook stages into a ring)
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User=$SVC_USER
Group=$SVC_USER
WorkingDirectory=$APP_DIR
Environment=PYTHONPATH=$APP_DIR PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
ExecStart=$PYTHON -m relay ${ARGS[*]}
Restart=on-failure
RestartSec=2
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RemoveIPC=yes
ProtectProc=invisible
ProcSubset=pid
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallErrorNumber=EPERM
CapabilityBoundingSet=$caps
AmbientCapabilities=$caps
UMask=0077
MemoryMax=384M
TasksMax=64
LimitNOFILE=4096

[Install]
WantedBy=multi-user.target
EOF
    mv "/etc/systemd/system/$UNIT.service.tmp" "/etc/systemd/system/$UNIT.service"
    systemctl daemon-reload
    systemctl enable --quiet "$UNIT"
    systemctl restart "$UNIT"
    if ! wait_listening; then
        journalctl -u "$UNIT" -n 30 --no-pager >&2 || true
        die "the relay did not start listening on port $PORT (systemctl status $UNIT)"
    fi
    log "relay running under systemd as $UNIT.service on port $PORT"
else
    MODE=detached
    if [ -n "$PREFIX" ]; then
        log "prefixed install: starting the relay detached, not under systemd"
    else
        log "systemd is not running here: starting the relay detached (no restart on failure or reboot)"
    fi
    stop_detached
    touch "$LOG_FILE"
    chown "$SVC_USER:$SVC_USER" "$LOG_FILE"
    chmod 0640 "$LOG_FILE"
    # setsid leaves the SSH session; setpriv drops to the service user; both exec, so $! is the relay.
    (
        cd "$APP_DIR"
        export PYTHONPATH="$APP_DIR" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
        setsid setpriv --reuid="$SVC_USER" --regid="$SVC_USER" --init-groups --no-new-privs \
            "$PYTHON" -m relay "${ARGS[@]}" </dev/null >>"$LOG_FILE" 2>&1 &
        echo $! >"$PID_FILE"
    )
    if ! wait_listening || ! is_relay "$(cat "$PID_FILE")"; then
        tail -n 30 "$LOG_FILE" >&2 || true
        die "the relay did not start listening on port $PORT (log: $LOG_FILE)"
    fi
    log "relay running detached, pid $(cat "$PID_FILE"), log $LOG_FILE"
    echo "KIT_PID_FILE=$PID_FILE"
    echo "KIT_LOG=$LOG_FILE"
fi

open_firewall

FINGERPRINT="$(openssl x509 -in "$CERT" -noout -fingerprint -sha256 | sed 's/^.*=//')"
echo "KIT_MODE=$MODE"
echo "KIT_PORT=$PORT"
echo "KIT_FINGERPRINT=$FINGERPRINT"
echo "KIT_TOKEN=$(cat "$TOKEN_FILE")"
