"""Code rewards: the completion's last fenced code block, run against the problem's tests.

Tests come as the datasets ship them (a JSON string or an already-decoded object):
  {"inputs": [...], "outputs": [...]}   stdin/stdout pairs (APPS / TACO / Eurus `input_output`,
                                        also nested as {"input_output": "<json>"});
  {"fn_name": "f", "inputs": [[args]], "outputs": [result]}   call-based (APPS / TACO; a
                                        LeetCode-style `class Solution` method works too);
  ["assert f(1) == 2", ...] or {"asserts": [...]} or one string of assert lines (MBPP style).
Each test runs in its own sandboxed process (tlt_jax/rl/sandbox.py); a stdin/stdout test passes
when the program exits 0 and its output equals the expected one token by token (trailing
whitespace and blank lines do not count); an assert test passes when the program, with that assert
(or a call-based check) appended, reaches a random marker printed after it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets

from tlt_jax.rl.sandbox import Limits, run_python

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class CodeSpec:
  # "all": 1.0 only when every test passes; "fraction": passed / total
  partial: str = "all"
  max_tests: int = 16  # the first N tests of a problem (long Eurus/TACO lists cost seconds each)
  limits: Limits = Limits()


def extract_code(completion: str) -> str | None:
  """The last fenced code block (```python, ```py or bare ```), else None."""
  blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
  blocks = [body for lang, body in blocks if lang in ("", "python", "py", "python3")]
  return blocks[-1] if blocks else None


def parse_tests(tests) -> list[tuple[str, str]]:
  """[(kind, payload...)] as ("io", stdin, expected), ("call", fn_name, args JSON, expected
  JSON) or ("assert", line) tuples."""
  if isinstance(tests, str):
    stripped = tests.strip()
    if stripped.startswith(("{", "[")):
      tests = json.loads(stripped)
    else:
      tests = [line for line in stripped.splitlines() if line.strip()]
      if not any(line.lstrip().startswith("assert") for line in tests):
        raise ValueError(f"neither JSON tests nor assert lines: {stripped[:80]!r}")
  if isinstance(tests, dict) and "input_output" in tests:
    return parse_tests(tests["input_output"])
  if isinstance(tests, dict) and "inputs" in tests:
    inputs, outputs = tests["inputs"], tests["outputs"]
    if len(inputs) != len(outputs):
      raise ValueError(f"{len(inputs)} test inputs but {len(outputs)} outputs")
    if tests.get("fn_name"):  # call-based (APPS / TACO): arguments in, the return value out
      return [("call", tests["fn_name"], json.dumps(i), json.dumps(o))
              for i, o in zip(inputs, outputs)]
    return [("io", _text(i), _text(o)) for i, o in zip(inputs, outputs)]
  if isinstance(tests, dict) and "asserts" in tests:
    tests = tests["asserts"]
  if isinstance(tests, list) and all(isinstance(t, str) for t in tests):
    return [("assert", t) for t in tests]
  raise ValueError(f"unrecognised code tests: {str(tests)[:80]!r}")


def _text(value) -> str:
  return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _same_output(got: str, expected: str) -> bool:
  return got.split() == expected.split()


def _call_check(fn_name: str, args_json: str, expected_json: str) -> str:
  """An assert on a call-based test: the function (or LeetCode-style `Solution().method`) called
  with the arguments returns the expected value, or the value APPS wraps in a one-item list
  (tuples compare as lists, as they would after JSON)."""
  return (f"import json as _json\n"
          f"_f = globals().get({fn_name!r}) or getattr(globals()['Solution'](), {fn_name!r})\n"
          f"_got = _json.loads(_json.dumps(_f(*_json.loads({args_json!r}))))\n"
          f"_want = _json.loads({expected_json!r})\n"
          f"assert _got == _want or [_got] == _want\n")


def _passes(code: str, test: tuple, limits: Limits) -> bool:
  if test[0] == "io":
    result = run_python(code, test[1], limits)
    return result.returncode == 0 and _same_output(result.stdout, test[2])
  marker = f"tlt-pass-{secrets.token_hex(8)}"
  check = test[1] if test[0] == "assert" else _call_check(*test[1:])
  result = run_python(f"{code}\n\n{check}\nprint({marker!r})\n", "", limits)
  return result.returncode == 0 and result.stdout.rstrip().endswith(marker)


def code_reward(completion: str, tests, spec: CodeSpec = CodeSpec()) -> float:
  """The share of tests passed ("fraction") or 1.0 only if all pass ("all"); 0.0 without code."""
  code = extract_code(completion)
  cases = parse_tests(tests)[:spec.max_tests]
  if code is None or not cases:
    return 0.0
  passed = 0
  for case in cases:
    if _passes(code, case, spec.limits):
      passed += 1
    elif spec.partial == "all":
      return 0.0  # no need to run the rest
  return passed / len(cases)
