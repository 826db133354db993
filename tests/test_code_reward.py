"""Code rewards: fenced-code extraction, stdin/stdout and assert tests, partial credit, and
malicious programs (each one must score 0 and leave the run, the machine and the project alone)."""

import json
import os
import time

import pytest

from tlt_jax.rl import sandbox
from tlt_jax.rl.code_reward import CodeSpec, code_reward, extract_code, parse_tests
from tlt_jax.rl.scoring import RewardScorer, RewardSpec, reward_metrics

SUM_TESTS = {"inputs": ["1 2\n", "3 4\n", "10 -5\n"], "outputs": ["3\n", "7\n", "5\n"]}
EVEN_ASSERTS = ["assert is_even(2)", "assert not is_even(3)", "assert is_even(0)"]


def fenced(code: str, lang: str = "python") -> str:
  return f"Here is my solution.\n```{lang}\n{code}\n```\nIt reads the input and prints the sum."


CORRECT = fenced("a, b = map(int, input().split())\nprint(a + b)")
FAST = CodeSpec(limits=sandbox.Limits(wall_s=5, cpu_s=2, memory_mb=512))


def test_extract_the_last_python_block():
  text = "```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\n```text\nnot code\n```"
  assert extract_code(text) == "print(2)\n"
  assert extract_code("```\nx = 1\n```") == "x = 1\n"
  assert extract_code("no code at all") is None
  assert extract_code("```python\nprint(1)") is None  # cut off by the length limit


def test_test_formats_as_datasets_ship_them():
  io = parse_tests(json.dumps(SUM_TESTS))
  assert io[0] == ("io", "1 2\n", "3\n") and len(io) == 3
  nested = parse_tests({"input_output": json.dumps({"inputs": [["1", "2"]], "outputs": [["3"]]})})
  assert nested == [("io", "1\n2", "3")]
  assert parse_tests("assert f(1) == 2\nassert f(2) == 3") == [
      ("assert", "assert f(1) == 2"), ("assert", "assert f(2) == 3")]
  assert parse_tests({"asserts": EVEN_ASSERTS})[1] == ("assert", "assert not is_even(3)")
  assert parse_tests({"inputs": [[1, 2]], "outputs": [[3]], "fn_name": "f"}) == [
      ("call", "f", "[1, 2]", "[3]")]
  with pytest.raises(ValueError, match="neither JSON tests nor assert lines"):
    parse_tests("print(1)")


def test_correct_wrong_and_partial_solutions():
  assert code_reward(CORRECT, SUM_TESTS, FAST) == 1.0
  assert code_reward(fenced("a, b = map(int, input().split())\nprint(a - b)"), SUM_TESTS,
                     FAST) == 0.0
  positive_only = fenced("a, b = map(int, input().split())\nprint(abs(a) + abs(b))")  # 2 of 3
  assert code_reward(positive_only, SUM_TESTS, FAST) == 0.0
  fraction = CodeSpec(partial="fraction", limits=FAST.limits)
  assert code_reward(positive_only, SUM_TESTS, fraction) == pytest.approx(2 / 3)
  assert code_reward("I would add the numbers.", SUM_TESTS, FAST) == 0.0
  even = fenced("def is_even(n):\n  return n % 2 == 0")
  assert code_reward(even, EVEN_ASSERTS, FAST) == 1.0
  assert code_reward(fenced("def is_even(n):\n  return n > 1"), EVEN_ASSERTS,
                     fraction) == pytest.approx(1 / 3)
  # Exiting early skips the asserts: that is a failure, not a pass.
  assert code_reward(fenced("import sys\ndef is_even(n):\n  return 0\nsys.exit(0)"), EVEN_ASSERTS,
                     FAST) == 0.0


def test_call_based_tests_as_apps_and_taco_ship_them():
  tests = {"fn_name": "add_pair", "inputs": [[1, 2], [5, -5]], "outputs": [[3], [0]]}
  assert code_reward(fenced("def add_pair(a, b):\n  return a + b"), tests, FAST) == 1.0
  assert code_reward(fenced("def add_pair(a, b):\n  return a - b"), tests, FAST) == 0.0
  leetcode = {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9]], "outputs": [[0, 1]]}
  solution = ("class Solution:\n  def twoSum(self, nums, target):\n    seen = {}\n"
              "    for i, x in enumerate(nums):\n      if target - x in seen:\n"
              "        return (seen[target - x], i)\n      seen[x] = i")
  assert code_reward(fenced(solution), leetcode, FAST) == 1.0  # a tuple result compares as a list


def _unharmed(started: float, budget_s: float):
  """The run goes on: a correct answer still scores 1 and the attack cost at most its budget."""
  assert time.perf_counter() - started < budget_s
  assert code_reward(CORRECT, SUM_TESTS, FAST) == 1.0


def test_fork_bomb():
  t0 = time.perf_counter()
  bomb = fenced("import os\nwhile True:\n  os.fork()")
  assert code_reward(bomb, SUM_TESTS, FAST) == 0.0
  via_subprocess = fenced("import subprocess, sys\nwhile True:\n"
                          "  subprocess.Popen([sys.executable, '-c', "
                          "'import time; time.sleep(60)'])")
  assert code_reward(via_subprocess, SUM_TESTS, FAST) == 0.0
  # Native code cannot fork either (the seccomp filter); one fork at most, so this test is safe
  # even where the filter is missing. Threads still work.
  native = sandbox.run_python("import ctypes\nprint(ctypes.CDLL(None).fork())", "", FAST.limits)
  assert native.stdout == "-1\n"
  threads = sandbox.run_python("import threading\nt = threading.Thread(target=print, args=(5,))\n"
                               "t.start()\nt.join()", "", FAST.limits)
  assert threads.stdout == "5\n"
  _unharmed(t0, 20)


def test_infinite_loop_is_killed_at_the_wall_timeout():
  t0 = time.perf_counter()
  for code in ("while True:\n  pass", "import time\ntime.sleep(600)"):
    assert code_reward(fenced(code), SUM_TESTS, FAST) == 0.0
  _unharmed(t0, 3 * FAST.limits.wall_s)


def test_huge_allocation_fails_inside_the_sandbox():
  t0 = time.perf_counter()
  hog = fenced("x = bytearray(8 << 30)\nprint(3)")
  assert code_reward(hog, SUM_TESTS, FAST) == 0.0
  grow = fenced("chunks = []\nwhile True:\n  chunks.append(bytearray(64 << 20))")
  assert code_reward(grow, SUM_TESTS, FAST) == 0.0
  _unharmed(t0, 20)


def test_writing_outside_its_directory(tmp_path):
  target = tmp_path / "escaped.txt"
  big = fenced("with open('big.bin', 'wb') as f:\n  f.write(b'x' * (64 << 20))\nprint(3)")
  writer = fenced(f"open({str(target)!r}, 'w').write('pwned')\n"
                  "a, b = map(int, input().split())\nprint(a + b)")
  t0 = time.perf_counter()
  assert code_reward(big, SUM_TESTS, FAST) == 0.0  # past the file-size limit
  if sandbox.isolation() != "namespaces":
    pytest.skip("without namespaces the sandbox cannot stop writes our user may make")
  assert code_reward(writer, SUM_TESTS, FAST) == 0.0  # all but its own directory is read-only
  assert not target.exists()
  _unharmed(t0, 20)


def test_reading_the_projects_files():
  if sandbox.isolation() != "namespaces":
    pytest.skip("without namespaces the sandbox cannot hide files our user can read")
  config = os.path.join(sandbox.PROJECT_ROOT, "tlt_jax", "config.py")
  assert os.path.exists(config)
  # Prints the right sum only if it could read the project's config file.
  reader = fenced(f"text = open({config!r}).read()\n"
                  "a, b = map(int, input().split())\nprint(a + b if 'def validate' in text else 0)")
  assert code_reward(reader, SUM_TESTS, FAST) == 0.0
  lister = fenced(f"import os\nprint(sum(map(int, input().split())) if os.listdir("
                  f"{sandbox.PROJECT_ROOT!r}) else -1)")
  assert code_reward(lister, SUM_TESTS, FAST) == 0.0
  no_network = fenced("import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', 9))\nprint(3)")
  assert code_reward(no_network, SUM_TESTS, FAST) == 0.0


@pytest.mark.parametrize("kind", ["thread", "inline"])
def test_mixed_rows_through_the_scorer(kind):
  math_row = {"reward": "math", "answer": "12", "prompt": "?"}
  code_row = {"reward": "code", "tests": SUM_TESTS, "prompt": "?"}
  spec = RewardSpec(code=FAST)
  with RewardScorer(spec, workers=2, kind=kind) as scorer:
    scorer.submit(0, "so \\boxed{12}", math_row)
    scorer.submit(1, "\\boxed{13}", math_row)
    scorer.submit(2, CORRECT, code_row)
    scorer.submit(3, "no code", code_row)
    scorer.submit(4, "#### 12", "12")  # a plain reference is math
    results, _ = scorer.results()
  assert [results[i]["reward"] for i in range(5)] == [1.0, 0.0, 1.0, 0.0, 1.0]
  metrics = reward_metrics(results)
  assert metrics["reward_mean_math"] == pytest.approx(2 / 3)
  assert metrics["reward_mean_code"] == 0.5 and metrics["samples_code"] == 2
  assert metrics["math_decided_fast"] == 3


# --- mixed datasets (experiments/assets/rewards/) ---------------------------------------------
ASSETS = os.path.join(os.path.dirname(__file__), "..", "experiments", "assets", "rewards")
# Reference completions for the sample rows, in order (what a correct model would write).
MIXED_SOLUTIONS = [
    "48 / 2 = 24 in May, 48 + 24 = 72.\n#### 72",
    "$\\sqrt{36 \\cdot 4} = \\sqrt{144}$, so the answer is $\\boxed{12}$.",
    "It factors as $(x-3)(x+2)$: $\\boxed{\\{3, -2\\}}$",
    fenced("a, b = map(int, input().split())\nprint(a + b)"),
    fenced("def is_even(n):\n  return n % 2 == 0"),
    fenced("input()\nprint(max(map(int, input().split())))"),
]


def test_mixed_sample_rows_pick_their_reward_and_score_per_kind():
  from tlt_jax.data.sources import read_rows
  rows = read_rows(os.path.join(ASSETS, "mixed_sample.jsonl")).rows
  assert [r["reward"] for r in rows] == ["math"] * 3 + ["code"] * 3
  assert [r["answer"] for r in rows[:3]] == ["72", "12", "\\{-2, 3\\}"]
  spec = RewardSpec(code=FAST)
  with RewardScorer(spec, workers=2, kind="thread") as scorer:
    for i, (row, completion) in enumerate(zip(rows, MIXED_SOLUTIONS)):
      scorer.submit(2 * i, completion, row)
      scorer.submit(2 * i + 1, "I am not sure. \\boxed{7}\n```python\nprint(7)\n```", row)
    results, _ = scorer.results()
  assert [results[2 * i]["reward"] for i in range(6)] == [1.0] * 6
  assert [results[2 * i + 1]["reward"] for i in range(6)] == [0.0] * 6
  metrics = reward_metrics(results)
  assert metrics["reward_mean_math"] == metrics["reward_mean_code"] == 0.5
  assert metrics["samples_math"] == metrics["samples_code"] == 6


def test_eurus_layout_and_a_configurable_reward_field(tmp_path):
  from tlt_jax.data.sources import DataError, read_rows
  math_row, code_row = read_rows(os.path.join(ASSETS, "eurus_sample.jsonl"), layout="eurus").rows
  assert math_row["reward"] == "math" and math_row["answer"] == "\\frac{7}{8}"
  assert math_row["prompt"].startswith("Compute")  # the user turn, not the system prompt
  assert code_row["reward"] == "code"
  assert code_reward(fenced("print(input()[::-1])"), code_row["tests"], FAST) == 1.0
  path = tmp_path / "kinds.jsonl"
  path.write_text(json.dumps({"q": "1+1", "kind": "code", "io": SUM_TESTS}) + "\n"
                  + json.dumps({"q": "2+2", "kind": "algebra", "a": "4"}) + "\n")
  with pytest.raises(DataError, match=r"kinds.jsonl:2: field 'kind' is 'algebra'"):
    read_rows(str(path), prompt_field="q", answer_field="a", reward_field="kind", tests_field="io")
  path.write_text(json.dumps({"q": "1+1", "kind": "code", "io": "not tests"}) + "\n")
  with pytest.raises(DataError, match=r"kinds.jsonl:1: field 'io'"):
    read_rows(str(path), prompt_field="q", reward_field="kind", tests_field="io")
