"""`buf breaking`: proto/ as it is now against proto/ of the previous commit, so that the public
API does not drift unnoticed (run by .ci/run).

The previous commit is HEAD~1 on a clean checkout (CI tests the commit HEAD made), and HEAD itself
while proto/ has changes not yet committed (a change under review). A shallow clone without it
skips the check with one line.

A break made on purpose is listed in CHANGELOG.md and, in ACCEPTED below, by buf's own words for
it (rule, file and message). An accepted break matches only the comparison that makes it, the
change against the commit before it: once that change is the previous commit, buf reports it no
more, and the entry is reported stale, to be removed with the next change.

    python scripts/buf_breaking.py [--against REF]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACCEPTED = ROOT / ".ci" / "accepted-breaks.txt"


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def previous_commit() -> str | None:
    """The commit to compare against: HEAD with uncommitted proto changes, else HEAD~1; None
    when the clone does not have it (shallow)."""
    dirty = _git("status", "--porcelain", "--", "proto").stdout.strip()
    ref = "HEAD" if dirty else "HEAD~1"
    found = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    return found.stdout.strip() if found.returncode == 0 else None


def accepted() -> set[str]:
    """Accepted breaks: one `RULE path: message` a line; # starts a comment."""
    if not ACCEPTED.exists():
        return set()
    lines = (line.strip() for line in ACCEPTED.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def find_buf() -> str:
    found = subprocess.run(
        ["bash", str(ROOT / "scripts" / "buf_lint.sh"), "--which"], capture_output=True, text=True, check=False
    )
    if found.returncode != 0:
        raise SystemExit("buf not found; run: scripts/buf_lint.sh --install")
    return found.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="Commit to compare against (default: the previous one, see above).")
    ref = parser.parse_args().against or previous_commit()
    if ref is None:
        print("buf breaking skipped: a shallow clone without the previous commit (fetch with --depth=2)")
        return 0
    against = f".git#ref={ref},subdir=proto"
    run = subprocess.run(
        [find_buf(), "breaking", "proto", "--against", against, "--error-format=json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    found = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode not in (0, 100) or (run.returncode == 100 and not found):
        print(f"buf breaking failed to run: {(run.stderr or run.stdout).strip()}", file=sys.stderr)
        return run.returncode or 1
    ok = accepted()
    seen, breaks = set(), []
    for f in found:
        key = f"{f['type']} {f['path']}: {f['message']}"
        if key in ok:
            seen.add(key)
            print(f"accepted (CHANGELOG.md): {key}")
        else:
            breaks.append(f"{f['path']}:{f['start_line']}:{f['start_column']}: {f['type']}: {f['message']}")
    for stale in sorted(ok - seen):
        print(f"stale entry of {ACCEPTED.relative_to(ROOT)} (buf reports it no more; remove it): {stale}")
    for line in breaks:
        print(line, file=sys.stderr)
    if breaks:
        print(
            f"buf breaking: {len(breaks)} breaking change(s) against {ref[:12]}; if on purpose, list them in "
            f"CHANGELOG.md and {ACCEPTED.relative_to(ROOT)}",
            file=sys.stderr,
        )
        return 1
    print(f"buf breaking: no unaccepted breaking change against {ref[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
