"""How a round's rows become requests to a generation server: runs of one prompt with consecutive row keys folded
into one prompt with n copies, split to fit the server's limits, grouped into shared requests, and the seed of a
run's stream (generation/server_generator.py's ServerGenerator, and vllm_colocate.py's engine)."""

from posttrain.generation.sampling import mix64_int


def _runs(prompts: list[list[int]], keys: list[int], images: list[list] | None = None
          ) -> list[tuple[list[int], int, int]]:
    """Consecutive rows with one prompt and consecutive keys as (prompt, first key, copies); with each row's
    `images`, a run's rows also share their images (the same objects: a prompt's G rows), so that two prompts whose
    ids agree but whose images differ are runs of their own."""
    if len(keys) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(keys)} row keys.")
    runs: list[tuple[list[int], int, int]] = []
    for row, (prompt, key) in enumerate(zip(prompts, keys)):
        if runs and runs[-1][0] == prompt and runs[-1][1] + runs[-1][2] == key and \
                (images is None or _same_objects(images[row - 1], images[row])):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((list(prompt), key, 1))
    return runs


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _fitting_runs(runs: list[tuple[list[int], int, int]], max_seqs: int | None, max_tokens: int | None,
                  new_tokens: int) -> list[tuple[list[int], int, int]]:
    """`runs` with each run's copies split into runs (consecutive keys) small enough for one request: at most
    max_seqs copies and max_tokens tokens (copies x (prompt + new_tokens)); None: no limit."""
    out = []
    for prompt, key, copies in runs:
        cap = copies
        if max_seqs:
            cap = min(cap, max_seqs)
        if max_tokens:
            cap = min(cap, max(1, max_tokens // (len(prompt) + new_tokens)))
        for start in range(0, copies, cap):
            out.append((prompt, key + start, min(cap, copies - start)))
    return out


def _shared_requests(runs: list[tuple[list[int], int, int]], max_seqs: int | None = None,
                     max_tokens: int | None = None, new_tokens: int = 0) -> list[list[int]]:
    """Indices of consecutive runs with the same copy count, one list per request, each request within max_seqs
    sequences and max_tokens tokens (sequences x (its longest prompt + new_tokens)); None: no limit."""
    requests: list[list[int]] = []
    longest = 0  # the longest prompt of the request being filled
    for i, run in enumerate(runs):
        if requests and runs[requests[-1][0]][2] == run[2]:
            rows = (len(requests[-1]) + 1) * run[2]
            tokens = rows * (max(longest, len(run[0])) + new_tokens)
            if (not max_seqs or rows <= max_seqs) and (not max_tokens or tokens <= max_tokens):
                requests[-1].append(i)
                longest = max(longest, len(run[0]))
                continue
        requests.append([i])
        longest = len(run[0])
    return requests


def stream_seed(seed: int, key: int) -> int:
    """A server-side seed (31 bits) for the run whose first row key is `key` in the round seeded `seed`."""
    return mix64_int(mix64_int(seed) ^ key) & 0x7FFFFFFF
