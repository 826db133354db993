"""Math answer equivalence: our exact fast path first, HF math-verify for what it cannot decide.

`grade(completion, reference)` returns whether the completion's final answer matches and which
path decided it:
  "fast"         our extraction (tlt_jax/rl/rewards.py) and either the same normalised string or
                 two exact rationals (`0.5` vs `\\frac{1}{2}`, `1,000` vs `1000`): no sympy at all,
                 most GSM8K-style samples end here;
  "math_verify"  math-verify's LaTeX parser and verifier (sets, intervals, mixed numbers,
                 polynomials, units, currency, matrices) on our extracted answer, or on the whole
                 completion when we found none;
  "sympy"        our small sympy comparison, when math-verify could not parse one of the sides;
  "timeout"      math-verify overran its time limit (scored wrong).

Timeouts: math-verify's own limit is `signal.alarm`, which works only in a process's main thread.
There (a "process" reward worker, the inline scorer, a script) it is used as is. In any other
thread (the default "thread" reward workers) math-verify runs in a helper process owned by that
thread (`python -m tlt_jax.rl.math_verify_worker`, one per thread, started on first use), which is
killed and replaced when an answer overruns its wall limit, so a pathological expression costs one
restart and never blocks a worker thread.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading

from tlt_jax.rl.rewards import _sympy_equal, extract_answer, fast_path, normalize

PATHS = ("fast", "math_verify", "sympy", "timeout")
TIMEOUT_S = 3  # math-verify's limit per parse / verify call (whole seconds: signal.alarm)


def _as_latex(answer: str) -> str:
  """math-verify extracts from text: give it an answer as one boxed expression."""
  return answer if "\\boxed" in answer else f"$\\boxed{{{answer}}}$"


def math_verify_equal(gold: str, predicted: str, timeout_s: int = TIMEOUT_S) -> bool | None:
  """math-verify's verdict in this thread (signal timeouts: main thread only); None when it
  could not parse one of the sides."""
  from math_verify import parse, verify  # noqa: PLC0415 (math-verify (and sympy, antlr) only for answers the fast path cannot decide)
  g = parse(_as_latex(gold), parsing_timeout=timeout_s)
  p = parse(predicted, parsing_timeout=timeout_s)
  if not g or not p:
    return None
  return bool(verify(g, p, timeout_seconds=timeout_s))


class _Helper:
  """A math-verify process serving one thread: one JSON line in, one out, killed on overrun."""

  def __init__(self):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "tlt_jax.rl.math_verify_worker"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

  def ask(self, gold: str, predicted: str, wall_s: float) -> tuple[bool | None, bool]:
    """(verdict, timed out)."""
    self.proc.stdin.write(json.dumps([gold, predicted]) + "\n")
    self.proc.stdin.flush()
    ready, _, _ = select.select([self.proc.stdout], [], [], wall_s)
    if not ready:
      self.close()
      return None, True
    line = self.proc.stdout.readline()
    if not line:  # the helper died (e.g. out of memory): a wrong answer, a fresh helper next
      self.close()
      return None, True
    return json.loads(line), False

  def close(self):
    self.proc.kill()
    self.proc.wait()


_local = threading.local()


def _math_verify_in_helper(gold: str, predicted: str) -> tuple[bool | None, bool]:
  helper = getattr(_local, "helper", None)
  if helper is None or helper.proc.poll() is not None:
    helper = _local.helper = _Helper()
  # Parse gold + parse prediction + verify, each limited in the helper; the first call also pays
  # the helper's import of sympy and math-verify (~1 s).
  verdict, timed_out = helper.ask(gold, predicted, 3 * TIMEOUT_S + 5)
  if timed_out:
    _local.helper = None
  return verdict, timed_out


def grade(completion: str, reference: str) -> tuple[bool, str]:
  """(correct, the path that decided: one of PATHS)."""
  predicted = extract_answer(completion)
  decided = fast_path(predicted, reference)
  if decided is not None:
    return decided, "fast"
  target = _as_latex(predicted) if predicted is not None else completion
  if threading.current_thread() is threading.main_thread():
    verdict, timed_out = math_verify_equal(reference, target), False
  else:
    verdict, timed_out = _math_verify_in_helper(reference, target)
  if timed_out:
    return False, "timeout"
  if verdict is not None:
    return verdict, "math_verify"
  return predicted is not None and _sympy_equal(normalize(predicted), normalize(reference)), "sympy"
