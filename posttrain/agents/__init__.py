"""Agents: GRPO with tools, environments and rollout_func, token-in/token-out (issue 34)."""
