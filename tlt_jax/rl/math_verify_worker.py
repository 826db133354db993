"""math-verify in its own process for the reward threads (tlt_jax/rl/equivalence.py): reads
[gold, predicted] JSON lines on stdin, writes the verdict (true / false / null = unparsable) on
stdout. It runs in its process's main thread, so math-verify's own signal timeouts work here."""

import json
import logging
import sys

from tlt_jax.rl.equivalence import math_verify_equal


def main() -> None:
  logging.disable(logging.WARNING)  # math-verify logs every unparsable answer
  for line in sys.stdin:
    gold, predicted = json.loads(line)
    try:
      verdict = math_verify_equal(gold, predicted)
    except Exception:  # noqa: BLE001 (malformed model output is a wrong answer, not a crash)
      verdict = False
    sys.stdout.write(json.dumps(verdict) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
