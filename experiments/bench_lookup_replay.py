"""Accept length of the model-free arms, chains vs trees, on the RL job's own GRPO rollouts.

    python -m experiments.bench_lookup_replay     # ~2 min here
    python -m experiments.bench_lookup_replay --train-problems 16 --out lookup_replay_revisits.json

What a lookup round accepts does not depend on the device: verification is exact, so a draft
token is accepted iff it is the token the run emits there. This script runs bench_tlt's
baseline job (tiny_arith, 8 prompts x 4 samples, 10 steps, 2 rollout groups: the trajectory
every bench_tlt variant decodes, `same_trajectory`) once, records each step's prompts and
responses, and replays every rollout group's decoding in lockstep rounds through the engine's own
device search (`rollout.steps._lookup_drafts`, `_lookup_tree_chains`, `_chains_to_tree`) for
each lookup arm used in every round: a chain is accepted up to its first token that differs
from the response, a tree along the deepest path of the response's tokens from its root (the
walk `_verify_tree` does), and each round emits that plus one token. What a row looks up in is
the engine's: its group's rows still decoding (prompts and responses so far) and the bank the
engine's `rollout.bank.ResponseBank` picks for them (finished rows leave the bucket and enter
it, across steps): earlier responses to the rows' prompts first, then the newest of any prompt;
`accept_len_newest_only` is the same arm with the newest responses only
(`rollout.lookup_history_tokens` = 0). Each step's prompts go to the groups as the engine
routes them (`rollout.groups.route`: a prompt seen before to the group holding its responses).
Not replayed: the tuner (every round uses the arm), chunk boundaries, and the order in which
rows of a round finish (all of a round's finished rows enter the bank after it).
`--train-problems N` records a job training on N problems, so prompts come back (epochs over a
small dataset). History arms are replayed the same way through each rollout group's own
`HistoryDrafter` (kept across steps, with bench_tlt's global trie of 4096 tokens), fed as the
engine feeds it; a history tree accepts the longest prefix of the response any of its chains
shares (what the walk over their trie accepts).

Reported per arm: accept length (tokens emitted per row per round, plain decoding = 1), rounds,
verify tokens per row per round, and emitted tokens per verified token, the figure that decides
the arm on a device where a verify of a few tokens costs about one decode step (memory-bound),
and against it on one where it costs as many steps as tokens (this CPU, `forward.json`).
Prints one JSON object and writes experiments/results/lookup_replay.json (--out names another).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

from experiments import bench_tlt  # sets the 2 host devices before JAX starts

import jax
import jax.numpy as jnp
import numpy as np

import tlt_jax
from tlt_jax import logs
from tlt_jax.rl import step as step_lib
from tlt_jax.rollout import steps as steps_lib
from tlt_jax.rollout.bank import ResponseBank
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.groups import route
from tlt_jax.rollout.history import HistoryDrafter
from tlt_jax.rollout.tuner import parse_arms

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ARMS = ("lookup_chain2,lookup_chain4,lookup_chain8,lookup_tree4_2,lookup_tree4_3,lookup_tree8_3,"
        "history_chain4,history_tree4_2,history_tree4_3")
HISTORY_GLOBAL_TOKENS = 4096  # bench_tlt's history variant
NO_MATCH = -7  # a token id no text holds: a finished row's slot in the bucket matches nothing


def record_rollouts(steps: int, groups: int, train_problems: int = 0) -> tuple[list, object]:
  """[(prompts, responses) per step], the job's config: bench_tlt's baseline run."""
  logs.configure("warning")
  recorded = []
  score = step_lib.score

  def recording_score(job, ro):
    recorded.append(([np.asarray(p).tolist() for p in ro.prompts],
                     [np.asarray(t).tolist() for t in ro.tokens]))
    return score(job, ro)

  step_lib.score = recording_score
  try:
    with tempfile.TemporaryDirectory() as tmp:
      c = bench_tlt.variant_config("baseline", steps, tmp, "", groups=groups,
                                   train_problems=train_problems)
      tlt_jax.run_training(c, "baseline")
  finally:
    step_lib.score = score
  return recorded, c


def slots_for(prompts, responses, gen, P: int, N: int):
  """The bucket's state after each row emitted gen[r] tokens of its response (gen 0: finished,
  its slot matches nothing)."""
  B = len(prompts)
  prompt_BxP = np.zeros((B, P), np.int32)
  out_BxN = np.zeros((B, N), np.int32)
  prompt_len = np.ones((B,), np.int32)
  g = np.ones((B,), np.int32)
  for r, (p, y) in enumerate(zip(prompts, responses)):
    if gen[r]:
      prompt_BxP[r, :len(p)] = p
      out_BxN[r, :gen[r]] = y[:gen[r]]
      prompt_len[r], g[r] = len(p), gen[r]
    else:
      prompt_BxP[r, 0], out_BxN[r, 0] = NO_MATCH, NO_MATCH
  zeros = jnp.zeros((B,), jnp.int32)
  return steps_lib.Slots(
      cache=None, draft_cache=None, token=jnp.asarray(out_BxN[np.arange(B), g - 1]),
      pos=jnp.asarray(prompt_len + g - 1), prev_hidden=jnp.zeros((B, 1)), sample_id=zeros,
      gen=jnp.asarray(g), max_new=jnp.full((B,), N), done=jnp.zeros((B,), bool),
      live=jnp.ones((B,), bool), out_tokens=jnp.asarray(out_BxN),
      out_logprobs=jnp.zeros((B, 1)), out_hidden=jnp.zeros((B, 1, 1)),
      prompt_tokens=jnp.asarray(prompt_BxP))


def tree_accepts(tokens, parents, truth) -> int:
  """Depth of the deepest node a walk reaches following `truth` from the root."""
  cur, depth = 0, 0
  for t in truth:
    nxt = np.nonzero((parents == cur) & (tokens == t))[0]
    if not len(nxt):
      break
    cur, depth = int(nxt[0]), depth + 1
  return depth


def common_prefix(a, b) -> int:
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def group_shares(prompts, group_size: int, holds) -> list[list[int]]:
  """Each group's sample indices of a step whose samples list each prompt group_size times in
  a row, as `GroupedRollout` routes them (`holds[g](prompt)`: responses group g holds)."""
  per_prompt = route(prompts[::group_size], holds)
  return [[p * group_size + j for p in share for j in range(group_size)] for share in per_prompt]


def replay_history_arm(arm, recorded, groups: int, group_size: int):
  """The same lockstep replay for a history arm: each rollout group's own `HistoryDrafter`
  (kept across steps, with bench_tlt's global trie), fed each round as the engine feeds it
  (every live row's tokens, then proposals); a tree accepts along its trie, i.e. the longest
  prefix of the response any of its chains shares."""
  drafters = [HistoryDrafter(global_tokens=HISTORY_GLOBAL_TOKENS) for _ in range(groups)]
  rounds = row_rounds = emitted = 0
  for step, (prompts, responses) in enumerate(recorded):
    shares = group_shares(prompts, group_size, [d.holds for d in drafters])
    for history, share in zip(drafters, shares):
      ys = [responses[i] for i in share]
      ids = [step * len(prompts) + i for i in share]
      gen = np.ones((len(ys),), np.int32)
      for sid, p, y in zip(ids, [prompts[i] for i in share], ys):
        history.begin(sid, p)
        if len(y) <= 1:
          history.finish(sid, y)
      gen[[len(y) <= 1 for y in ys]] = 0
      while gen.any():
        live = np.nonzero(gen)[0]
        for r in live:
          history.extend(ids[r], ys[r][:gen[r]])
        chains = {int(r): (history.propose_chains(ids[r], arm.depth, arm.topk) if arm.is_tree
                           else [history.propose(ids[r], arm.depth)]) for r in live}
        for r in live:
          truth = ys[r][gen[r]:gen[r] + arm.depth]
          accepted = max((common_prefix(c, truth) for c in chains[int(r)]), default=0)
          n = min(accepted + 1, len(ys[r]) - gen[r])
          emitted += int(n)
          gen[r] += n
        rounds += 1
        row_rounds += len(live)
        for r in live:
          if gen[r] >= len(ys[r]):
            history.finish(ids[r], ys[r])
            gen[r] = 0
  return dict(arm=arm.name, accept_len=emitted / row_rounds, rounds=rounds,
              row_rounds=row_rounds, tokens=emitted, verify_tokens_per_row_round=arm.verify_tokens,
              emitted_per_verify_token=emitted / row_rounds / arm.verify_tokens)


def replay_arm(arm, recorded, groups: int, group_size: int, P: int, N: int, bank_size: int,
               max_order: int, history_tokens: int):
  chain = jax.jit(steps_lib._lookup_drafts, static_argnums=(3, 4))
  tree = jax.jit(lambda s, bank, bank_len, depth, width, order: steps_lib._chains_to_tree(
      s.token, *steps_lib._lookup_tree_chains(s, bank, bank_len, depth, width, order)),
      static_argnums=(3, 4, 5))
  banks = [ResponseBank(bank_size, N, history_tokens) for _ in range(groups)]
  rounds = row_rounds = emitted = 0
  for prompts, responses in recorded:
    for bank, share in zip(banks, group_shares(prompts, group_size, [b.holds for b in banks])):
      ps, ys = [prompts[i] for i in share], [responses[i] for i in share]
      gen = np.ones((len(ps),), np.int32)  # prefill emitted each row's first token
      finished = [len(y) <= 1 for y in ys]
      gen[finished] = 0
      for r in np.nonzero(finished)[0]:
        bank.add(ps[r], ys[r])
      while gen.any():
        s = slots_for(ps, ys, gen, P, N)
        bank_args = bank.arrays([tuple(ps[r]) for r in np.nonzero(gen)[0]])
        if arm.is_tree:
          tok, par, _, _ = (np.asarray(x) for x in tree(s, *bank_args, arm.depth, arm.topk,
                                                         max_order))
        else:
          drafts = np.asarray(chain(s, *bank_args, arm.depth, max_order))
        done_now = []
        live = np.nonzero(gen)[0]
        for r in live:
          truth = ys[r][gen[r]:gen[r] + arm.depth]
          if arm.is_tree:
            accepted = tree_accepts(tok[r], par[r], truth)
          else:
            accepted = 0
            while accepted < len(truth) and drafts[r, accepted] == truth[accepted]:
              accepted += 1
          n = min(accepted + 1, len(ys[r]) - gen[r])
          emitted += int(n)
          gen[r] += n
          if gen[r] >= len(ys[r]):
            done_now.append(r)
        rounds += 1
        row_rounds += len(live)
        for r in done_now:
          gen[r] = 0
          bank.add(ps[r], ys[r])
  return dict(arm=arm.name, accept_len=emitted / row_rounds, rounds=rounds,
              row_rounds=row_rounds, tokens=emitted, verify_tokens_per_row_round=arm.verify_tokens,
              emitted_per_verify_token=emitted / row_rounds / arm.verify_tokens)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--arms", default=ARMS)
  parser.add_argument("--train-problems", type=int, default=0,
                      help="training problems (default the config's 4096): fewer come back")
  parser.add_argument("--out", default="lookup_replay.json")
  args = parser.parse_args()
  t0 = time.perf_counter()
  recorded, c = record_rollouts(args.steps, 2, args.train_problems)
  record_s = time.perf_counter() - t0
  P, N = c.rollout.max_prompt_len, c.rollout.max_new_tokens
  arms = [a for a in parse_arms(args.arms) if a.depth]
  max_order = EngineConfig.lookup_max_order  # the engine's (not a run config key)
  G = c.rollout.group_size
  lookup = lambda arm, kept: replay_arm(arm, recorded, 2, G, P, N, c.rollout.lookup_bank,
                                       max_order, kept)
  results = [replay_history_arm(a, recorded, 2, G) if a.is_history else
             {**lookup(a, c.rollout.lookup_history_tokens),
              "accept_len_newest_only": lookup(a, 0)["accept_len"]}
             for a in arms]
  report = dict(
      command="python -m experiments.bench_lookup_replay" + (
          f" --train-problems {args.train_problems}" if args.train_problems else ""),
      job=f"bench_tlt baseline: tiny_arith, 8 prompts x 4 samples, {args.steps} steps, "
          "2 rollout groups",
      train_problems=c.data.synthetic_train,
      prompts_seen=len({tuple(p) for ps, _ in recorded for p in ps}),
      prompt_visits=sum(len(ps) for ps, _ in recorded) // c.rollout.group_size,
      responses=sum(len(ys) for _, ys in recorded),
      response_tokens=sum(len(y) for _, ys in recorded for y in ys),
      lookup_bank=c.rollout.lookup_bank, lookup_history_tokens=c.rollout.lookup_history_tokens,
      lookup_max_order=max_order, arms=results,
      record_s=record_s, seconds=time.perf_counter() - t0,
      platform=f"{jax.default_backend()} ({platform.machine()}, {os.cpu_count()} cores), "
               f"jax {jax.__version__}")
  os.makedirs(RESULTS_DIR, exist_ok=True)
  with open(os.path.join(RESULTS_DIR, args.out), "w") as f:
    json.dump(report, f, indent=2)
  print(json.dumps(report))


if __name__ == "__main__":
  main()
