#!/usr/bin/env python3
"""Container health probe: exit 0 when http://127.0.0.1:$PAGEDLLM_PORT/health answers 200, else 1.

/health is 503 while the server drains after SIGTERM and when the engine process died, so a container that
is stopping or broken reports unhealthy. Standard library only (no curl in the image)."""
import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("PAGEDLLM_PORT", "8000")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError) as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
