"""Answer extraction and equivalence on tricky cases (each one a way real completions go wrong)."""

import pytest

from tlt_jax.rl.rewards import extract_answer, format_reward, is_equivalent, math_reward

EXTRACT = [
    ("so the result is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("first \\boxed{3} then \\boxed{5}", "5"),
    ("\\boxed{x^{2}+1}", "x^{2}+1"),
    ("\\boxed{\\left( 1, 2 \\right)}", "\\left( 1, 2 \\right)"),
    ("\\fbox{7}", "7"),
    ("She pays 3 + 4 = 7 dollars.\n#### 7", "7"),
    ("#### 1,250", "1,250"),
    ("The answer is 12.", "12"),
    ("Final answer: -3", "-3"),
    ("answer: $\\frac{3}{4}$", "\\frac{3}{4}"),
    ("I computed 5 apples and then 8 pears", "8"),
    ("no digits at all", None),
    ("\\boxed{unbalanced", None),  # a box cut off by the length limit is no answer
    ("total is -0.5 now", "-0.5"),
]

EQUIVALENT = [
    ("42", "42"), ("1,000", "1000"), ("1000.0", "1000"), ("0.5", "\\frac{1}{2}"),
    ("\\dfrac{1}{2}", "1/2"), ("-\\frac{3}{4}", "-0.75"), ("\\frac12", "0.5"),
    ("3/6", "1/2"), ("$5$", "5"), ("5 dollars", "5"), ("\\text{5 cm}", "5"),
    ("50\\%", "50"), ("90^\\circ", "90"), ("x = 5", "5"), (" 7 ", "7"), ("7.", "7"),
    ("2\\sqrt{2}", "\\sqrt{8}"), ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"),
    ("\\pi/2", "\\frac{\\pi}{2}"), ("2^{10}", "1024"), ("12,345,678", "12345678"),
    ("-.5", "-0.5"), ("\\left(3\\right)", "3"), ("10.50", "10.5"),
]

NOT_EQUIVALENT = [
    ("41", "42"), ("1,001", "1000"), ("0.33", "\\frac{1}{3}"), ("-5", "5"),
    ("2\\sqrt{3}", "\\sqrt{8}"), ("1/0", "0"), ("", "0"), ("\\frac{1}{2", "0.5"), ("x^2", "x^3"),
    ("12", "1,2"),
]


@pytest.mark.parametrize("text,expected", EXTRACT)
def test_extract_answer(text, expected):
  assert extract_answer(text) == expected


@pytest.mark.parametrize("a,b", EQUIVALENT)
def test_equivalent(a, b):
  assert is_equivalent(a, b) and is_equivalent(b, a)


@pytest.mark.parametrize("a,b", NOT_EQUIVALENT)
def test_not_equivalent(a, b):
  assert not is_equivalent(a, b)


def test_rewards_end_to_end():
  assert math_reward("... so \\boxed{\\frac{6}{8}}", "0.75") == 1.0
  assert math_reward("#### 1,200", "1200") == 1.0
  assert math_reward("I think 7", "8") == 0.0
  assert math_reward("nothing", "8") == 0.0
  assert is_equivalent(None, "1") is False
  assert format_reward("\\boxed{1}") == 1.0 and format_reward("The answer is 3") == 1.0
  assert format_reward("3") == 0.0


# Rows exactly as the datasets ship them (field names and text copied from their public files).
GSM8K_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                "clips to her friends in May. How many clips did Natalia sell altogether in April "
                "and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
              "<<48+24=72>>72 clips altogether in April and May.\n#### 72"}
MATH_ROW = {  # hendrycks MATH: the answer is the last \boxed{} of the worked solution
    "problem": "If $x^2+y^2=1$, what is the largest possible value of $|x|+|y|$?",
    "level": "Level 5", "type": "Algebra",
    "solution": "If $(x,y)$ lies on the circle, so does $(x,-y),$ $(-x,-y),$ and $(-x,-y),$ (which "
                "all give the same value of $|x| + |y|$), so we can assume that $x \\ge 0$ and "
                "$y \\ge 0.$\n\nThen $|x| + |y| = x + y.$  Squaring, we get\n\\[(x + y)^2 = x^2 + "
                "2xy + y^2 = 1 + 2xy.\\]Note that $(x - y)^2 \\ge 0.$ ... Hence, the maximum value "
                "is $\\boxed{\\sqrt{2}}.$"}
MATH500_ROW = {  # HuggingFaceH4/MATH-500: a plain `answer` field beside the solution
    "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
    "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$ ... \\[\\boxed{\\left( 3, "
                "\\frac{\\pi}{2} \\right)}.\\]",
    "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
    "unique_id": "test/precalculus/807.json"}


def _rows(tmp_path, record, **fields):
  import json

  from tlt_jax.data.sources import read_rows
  path = tmp_path / "rows.jsonl"
  path.write_text(json.dumps(record) + "\n")
  return read_rows(str(path), **fields).rows


def test_reference_answers_are_taken_from_the_datasets_formats_at_load_time(tmp_path):
  [gsm] = _rows(tmp_path, GSM8K_ROW)
  assert gsm["answer"] == "72" and gsm["answer_raw"] == GSM8K_ROW["answer"]
  [math] = _rows(tmp_path, MATH_ROW, prompt_field="problem", answer_field="solution")
  assert math["answer"] == "\\sqrt{2}" and math["answer_raw"] == MATH_ROW["solution"]
  [m500] = _rows(tmp_path, MATH500_ROW, prompt_field="problem", answer_field="answer")
  assert m500["answer"] == MATH500_ROW["answer"]
  [m500_solution] = _rows(tmp_path, MATH500_ROW, prompt_field="problem", answer_field="solution")
  assert m500_solution["answer"] == MATH500_ROW["answer"]


def test_a_correct_completion_on_a_gsm8k_row_is_rewarded(tmp_path):
  [row] = _rows(tmp_path, GSM8K_ROW)
  completion = ("In May she sold 48 / 2 = 24 clips, so 48 + 24 = 72 in all. "
                "So the answer is \\boxed{72}.")
  assert math_reward(completion, row["answer"]) == 1.0
  assert math_reward(completion.replace("72", "70"), row["answer"]) == 0.0
  # The bug this fixes: against the raw worked solution every correct completion scored 0.
  assert math_reward(completion, row["answer_raw"]) == 0.0


# --- math equivalence on hand-labeled completions (experiments/assets/rewards/) ---------------
def _labeled_cases():
  import json
  import os
  path = os.path.join(os.path.dirname(__file__), "..", "experiments", "assets", "rewards",
                      "math_equivalence_cases.jsonl")
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


LABELED = _labeled_cases()
# Where the combined grader still disagrees with the human label (reported in BENCHMARKS.md).
KNOWN_WRONG = {("interval", "(-\\infty, 3)")}


def test_the_labeled_set_is_large_and_balanced():
  assert len(LABELED) >= 80
  assert 0.25 < sum(c["correct"] for c in LABELED) / len(LABELED) < 0.75
  assert len({c["category"] for c in LABELED}) >= 20


@pytest.mark.parametrize("case", LABELED, ids=lambda c: f"{c['category']}-{c['reference'][:12]}")
def test_combined_grader_agrees_with_the_human_label(case):
  from tlt_jax.rl.equivalence import grade
  if (case["category"], case["reference"]) in KNOWN_WRONG:
    pytest.xfail("math-verify compares an inequality with an interval only one way round")
  correct, path = grade(case["completion"], case["reference"])
  assert correct == case["correct"], path


def test_math_verify_runs_in_a_helper_process_off_the_main_thread():
  import concurrent.futures as cf

  from tlt_jax.rl import equivalence
  cases = [("\\boxed{\\{3,2,1\\}}", "\\{1,2,3\\}", True), ("\\boxed{3.14159}", "\\pi", False),
           ("\\boxed{x^2+2x+1}", "(x+1)^2", True), ("#### 12", "12", True)]
  with cf.ThreadPoolExecutor(2) as pool:  # signal-based timeouts would raise in these threads
    graded = list(pool.map(lambda c: equivalence.grade(c[0], c[1]), cases))
  assert [g[0] for g in graded] == [c[2] for c in cases]
  assert [g[1] for g in graded] == ["math_verify", "math_verify", "math_verify", "fast"]


def test_a_helper_that_overruns_is_killed_and_replaced():
  from tlt_jax.rl import equivalence
  helper = equivalence._Helper()
  # The helper's first answer needs its imports (~1 s): a 1 ms limit must kill it, not hang.
  verdict, timed_out = helper.ask("1", "\\boxed{1}", wall_s=0.001)
  assert verdict is None and timed_out and helper.proc.poll() is not None
  fresh = equivalence._Helper()
  assert fresh.ask("\\{1,2\\}", "\\boxed{\\{2,1\\}}", wall_s=60) == (True, False)
  fresh.close()
