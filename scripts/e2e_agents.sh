#!/usr/bin/env bash
# End to end: the released Claude Code and Codex CLIs, unmodified, against `ferrite serve`.
#
# Installs @anthropic-ai/claude-code and @openai/codex from npm (pinned below) into
# $FERRITE_HOME/agents-npm once, starts `ferrite serve MODEL` on a free port of 127.0.0.1, and
# runs one non-interactive turn of each — `claude -p …` over Anthropic Messages, `codex exec …`
# over Responses — asking it to run a shell command that writes a marker file. It passes when
# each client exits 0 and the marker holds what the command wrote: the model called the shell
# tool, the client ran it, and the tool result went back for a final answer.
#
# Both clients run with a scratch HOME/CODEX_HOME, their update checks, telemetry and error
# reporting off, and a base URL on 127.0.0.1: they talk to nothing else. Short system prompts
# and Claude Code's Bash tool alone keep their prompts small enough for a CPU run.
#
#   bash scripts/e2e_agents.sh [MODEL]     # default qwen2.5-coder-1.5b (SmolLM2's context
#                                          # holds neither client's prompt)
# Env: FERRITE_BIN (default target/release/ferrite), FERRITE_HOME, E2E_TIMEOUT (seconds per
# client, default 1800), E2E_RECORD=DIR (point the clients at scripts/record_agent_requests.py
# instead and record their requests into DIR/claude-code.jsonl and DIR/codex.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
CLAUDE_CODE_VERSION=2.1.332
CODEX_VERSION=0.171.0
MODEL=${1:-qwen2.5-coder-1.5b}
BIN=${FERRITE_BIN:-target/release/ferrite}
HOME_DIR=${FERRITE_HOME:-$HOME/.cache/ferrite}
NPM_DIR=$HOME_DIR/agents-npm
TIMEOUT=${E2E_TIMEOUT:-1800}
started=$(date +%s)

# --- install the pinned clients (once) ---------------------------------------------------
pins="@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION @openai/codex@$CODEX_VERSION"
if [[ "$(cat "$NPM_DIR/pins.txt" 2>/dev/null)" != "$pins" ]]; then
  echo "installing $pins into $NPM_DIR" >&2
  mkdir -p "$NPM_DIR"
  # shellcheck disable=SC2086
  npm install --prefix "$NPM_DIR" --no-audit --no-fund --loglevel=error $pins >&2
  # npm may skip the postinstall that puts the native binary in place; it is idempotent.
  (cd "$NPM_DIR/node_modules/@anthropic-ai/claude-code" && node install.cjs >&2)
  echo "$pins" > "$NPM_DIR/pins.txt"
fi
CLAUDE=$NPM_DIR/node_modules/.bin/claude
CODEX=$NPM_DIR/node_modules/.bin/codex
"$CLAUDE" --version >&2
"$CODEX" --version >&2

# --- the server ----------------------------------------------------------------------------
work=$(mktemp -d)
server_pid=
cleanup() {
  if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
if [[ -n "${E2E_RECORD:-}" ]]; then
  mkdir -p "$E2E_RECORD"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 scripts/record_agent_requests.py --port "$port" --log "$work/requests.jsonl" > "$work/server.log" 2>&1 &
  server_pid=$!
else
  [[ -x "$BIN" ]] || cargo build --release --bin ferrite
  "$BIN" serve "$MODEL" --host 127.0.0.1 --port 0 --served-model-name "$MODEL" > "$work/server.log" 2>&1 &
  server_pid=$!
fi
url=
for _ in $(seq 600); do
  url=$(grep -oE 'listening on http://[0-9.:]+' "$work/server.log" | head -1 | sed 's/listening on //') || true
  [[ -n "$url" ]] && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log" >&2; exit 1; }
  sleep 0.5
done
[[ -n "$url" ]] || { echo "the server did not start" >&2; cat "$work/server.log" >&2; exit 1; }
echo "server at $url ($MODEL)" >&2

failed=0
record() { # record NAME: move the recorded requests aside
  if [[ -n "${E2E_RECORD:-}" && -f "$work/requests.jsonl" ]]; then mv "$work/requests.jsonl" "$E2E_RECORD/$1.jsonl"; fi
}
check() { # check NAME MARKER STATUS LOG
  local name=$1 marker=$2 status=$3 log=$4
  if [[ "$status" == 0 && "$(cat "$marker" 2>/dev/null)" == "ferrite-e2e" ]]; then
    echo "PASS $name" >&2
  else
    echo "FAIL $name (exit $status, marker: $(cat "$marker" 2>/dev/null || echo none))" >&2
    tail -20 "$log" >&2
    failed=$((failed + 1))
  fi
}
PROMPT="Use your shell tool to run exactly this command: echo ferrite-e2e > marker.txt"

# --- Claude Code over Anthropic Messages ----------------------------------------------------
mkdir -p "$work/claude/home" "$work/claude/project"
t0=$(date +%s)
set +e
(cd "$work/claude/project" && env -u ANTHROPIC_AUTH_TOKEN HOME="$work/claude/home" \
  ANTHROPIC_BASE_URL="$url" ANTHROPIC_API_KEY=sk-local ANTHROPIC_MODEL="$MODEL" \
  ANTHROPIC_SMALL_FAST_MODEL="$MODEL" ANTHROPIC_DEFAULT_HAIKU_MODEL="$MODEL" \
  CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 \
  DISABLE_ERROR_REPORTING=1 DISABLE_BUG_COMMAND=1 CLAUDE_CODE_MAX_CONTEXT_TOKENS=32768 \
  timeout "$TIMEOUT" "$CLAUDE" -p "$PROMPT" --model "$MODEL" --bare --tools Bash \
    --allowedTools Bash --system-prompt "You are a coding agent. Run commands with the Bash tool." \
  > "$work/claude.log" 2>&1)
status=$?
set -e
check "claude -p ($(( $(date +%s) - t0 )) s)" "$work/claude/project/marker.txt" "$status" "$work/claude.log"
record claude-code

# --- Codex over Responses -----------------------------------------------------------------
mkdir -p "$work/codex/home" "$work/codex/project"
echo "You are a coding agent. Run commands with the exec_command tool, in the current directory: give only the cmd argument." > "$work/codex/instructions.md"
cat > "$work/codex/home/config.toml" <<EOF
model = "$MODEL"
model_provider = "ferrite"
check_for_update_on_startup = false
model_instructions_file = "$work/codex/instructions.md"

[model_providers.ferrite]
name = "ferrite"
base_url = "$url/v1"
wire_api = "responses"

[analytics]
enabled = false
EOF
t0=$(date +%s)
set +e
(cd "$work/codex/project" && env -u OPENAI_API_KEY -u OPENAI_BASE_URL HOME="$work/codex/home" \
  CODEX_HOME="$work/codex/home" timeout "$TIMEOUT" "$CODEX" exec --skip-git-repo-check \
    -s danger-full-access "$PROMPT" > "$work/codex.log" 2>&1)
status=$?
set -e
check "codex exec ($(( $(date +%s) - t0 )) s)" "$work/codex/project/marker.txt" "$status" "$work/codex.log"
record codex

echo "$((2 - failed)) passed, $failed failed ($(( $(date +%s) - started )) s)"
[[ "$failed" == 0 ]]
