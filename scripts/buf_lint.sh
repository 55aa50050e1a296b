#!/usr/bin/env bash
# Lint proto/ with buf, as configured by buf.yaml at the repository root.
#
#   scripts/buf_lint.sh [ARGS...]            buf lint ARGS, with the first buf found of: $BUF, `buf` on
#                                            PATH, the npm install in $GRADPS_TOOLS_DIR (exit 3: none)
#   scripts/buf_lint.sh --install [ARGS...]  the same, installing buf from npm first if none is found
#   scripts/buf_lint.sh --which              print the buf it would use (exit 3: none)
#
# buf is the npm package @bufbuild/buf (its native binary comes in @bufbuild/buf-linux-x64 and the
# like), installed outside the repository into $GRADPS_TOOLS_DIR (default ~/.cache/gradps-tools).
# Installing needs the npm registry; linting is offline.
set -euo pipefail

BUF_VERSION="${BUF_VERSION:-1.75.0}"
TOOLS_DIR="${GRADPS_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gradps-tools}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

find_buf() {
  if [[ -n "${BUF:-}" ]]; then
    [[ -x "$BUF" ]] && echo "$BUF" && return 0
    echo "BUF=$BUF is not an executable" >&2
    return 1
  fi
  command -v buf 2>/dev/null && return 0
  [[ -x "$TOOLS_DIR/node_modules/.bin/buf" ]] && echo "$TOOLS_DIR/node_modules/.bin/buf" && return 0
  return 1
}

install_buf() {
  command -v npm >/dev/null || { echo "npm is needed to install buf" >&2; exit 3; }
  mkdir -p "$TOOLS_DIR"
  echo "installing @bufbuild/buf@$BUF_VERSION into $TOOLS_DIR" >&2
  npm install --prefix "$TOOLS_DIR" --no-save --no-audit --no-fund --loglevel=error "@bufbuild/buf@$BUF_VERSION" >&2
}

case "${1:-}" in
  --which)
    find_buf || { echo "buf not found; run: scripts/buf_lint.sh --install" >&2; exit 3; }
    exit 0
    ;;
  --install)
    shift
    find_buf >/dev/null || install_buf
    ;;
esac

BUF_BIN="$(find_buf)" || { echo "buf not found; run: scripts/buf_lint.sh --install" >&2; exit 3; }
cd "$ROOT"
echo "$("$BUF_BIN" --version | head -n1) lint" >&2
exec "$BUF_BIN" lint "$@"
