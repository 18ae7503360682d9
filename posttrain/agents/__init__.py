"""Agents: GRPO with tools, environments and rollout_func, token-in/token-out (issue 34)."""

# tools, environments and rollout_func's output (tools.py, environments.py, rollout_func.py)
from posttrain.agents.environments import EnvironmentBatch, EnvironmentPool  # noqa: E402,F401
from posttrain.agents.rollout_func import RolloutOutput, RolloutOutputError, check_rollout_output  # noqa: E402,F401
from posttrain.agents.tools import ToolError, ToolResults, ToolRunner, ToolSet, tool_schema  # noqa: E402,F401
# the chat template's side: the model's turns read for tool calls, the tool results' ids (tool_parsing.py,
# chat_templates.py, response_formats.py)
from posttrain.agents.chat_templates import ToolSuffix, tool_chat_template  # noqa: E402,F401
from posttrain.agents.tool_parsing import ParsedTurn, ToolCallParser  # noqa: E402,F401
