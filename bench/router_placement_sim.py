"""A quick model of the router's prefix placement (no engines, seconds): vLLM's prefix cache as an LRU of
blocks per replica, one or two routers (choice.Picker) taking the requests in turn, round robin and the bare
consistent-hash ring for comparison. Sequential requests (no concurrency, no bounded-load spills): it compares
where prompts are placed, not timing.

    .venv/bin/python bench/router_placement_sim.py

Prints the modelled prefix-cache hit rate (averaged over --seeds traces) per policy; docs/router.md quotes it
for two routers.
"""
from __future__ import annotations

import argparse
import collections
import random

from gpufleet_router.policy.choice import Picker
from gpufleet_router.policy.prefixes import prefix_of
from gpufleet_router.policy.replicas import Reading, Replica

BLOCK_CHARS = 128     # 32-token blocks at the router's 4 characters a token


class Cache:
    """A replica's prefix cache: whole blocks, least recently used evicted first."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self.lru: collections.OrderedDict = collections.OrderedDict()

    def run(self, chain: list) -> int:
        hit = 0
        while hit < len(chain) and chain[hit] in self.lru:
            hit += 1
        for block in reversed(chain):   # vLLM frees a request's blocks tail first
            self.lru[block] = None
            self.lru.move_to_end(block)
        while len(self.lru) > self.blocks:
            self.lru.popitem(last=False)
        return hit


def simulate(policy: str, replicas: int, prompts: int, requests: int, pool: int, prompt_blocks: int,
             routers: int, seed: int) -> float:
    pods = [f"replica-{i}" for i in range(replicas)]
    pickers = [Picker() for _ in range(routers)]
    for picker in pickers:
        picker.set_replicas([Replica(pod, pod) for pod in pods])
        for pod in pods:
            picker.observe(pod, Reading(0.0, True, 10 ** 6, pool))
    caches = {pod: Cache(pool) for pod in pods}
    rng = random.Random(seed)
    hits = queries = 0
    for i in range(requests):
        p = rng.randrange(prompts)
        text = f"system prompt {p} ".ljust(BLOCK_CHARS * prompt_blocks, ".") + f" question {i}?"
        chain = [(p, j) for j in range(prompt_blocks)] + [("question", i)]   # the question: never shared
        if policy == "round robin":
            pod = pods[i % replicas]
        else:
            picker = pickers[i % routers]
            learned = policy == "learned"
            prefix = prefix_of(text, BLOCK_CHARS, 4, match_blocks=64 if learned else 0)
            pod = picker.pick(1, prefix).replica.pod
            picker.finished(pod, picker.sent(pod, 1, 0.0, prefix if learned else None))
        hits += caches[pod].run(chain)
        queries += len(chain)
    return hits / queries


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--requests", type=int, default=240)
    args = ap.parse_args()
    print("| replicas | prompts | routers | round robin | bare ring | learned placement |")
    print("|---|---|---|---|---|---|")
    for replicas, prompts in ((2, 10), (4, 8), (4, 16)):
        for routers in (1, 2):
            rates = [sum(simulate(policy, replicas, prompts, args.requests, 64, 11, routers, seed)
                         for seed in range(args.seeds)) / args.seeds
                     for policy in ("round robin", "ring", "learned")]
            print(f"| {replicas} | {prompts} | {routers} | " + " | ".join(f"{r:.3f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
