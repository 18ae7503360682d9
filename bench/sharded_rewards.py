"""The reward bench/sharded.sh trains with: the share of distinct tokens in a completion (it varies between the
completions of a random model, which forced-length completions and `length` would not)."""


def distinct_tokens(completion_ids, **kwargs) -> list[float]:
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]
