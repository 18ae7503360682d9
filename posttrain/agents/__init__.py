"""Agents: GRPO with tools, environments and rollout_func, token-in/token-out (issue 34)."""

# tools, environments and rollout_func's output (tools.py, environments.py, rollout_func.py)
from posttrain.agents.environments import EnvironmentBatch, EnvironmentPool  # noqa: E402,F401
from posttrain.agents.rollout_func import RolloutOutput, RolloutOutputError, check_rollout_output  # noqa: E402,F401
from posttrain.agents.tools import ToolError, ToolResults, ToolRunner, ToolSet, tool_schema  # noqa: E402,F401
