"""The lean decoder's fixed-shape step captured in a CUDA graph and replayed once per token (cache_implementation=
"static" on CUDA).

A decode step is hundreds of small kernels (a few per layer and row block); launched one by one from Python the GPU
waits on the host between them. The fixed-shape step (generation/lean_decoder.py `fixed_shape`) is what capture
needs: every tensor it reads or writes keeps its shape and address from token to token (the preallocated cache, the
key mask, the cursor on the device, the weights), and it makes no host sync. So after the prefill (eager: its width
is the round's) the step is captured once for the decode's shape (its rows and cache length: one capture per round,
about the cost of three steps) and each token copies its ids and positions into the captured inputs and replays it.

The weights are read where they lie: an optimizer step between rounds updates them in place, and each round
captures anew. Where capture fails (a kernel that cannot be captured), the steps run eagerly, said once.
"""

import torch

from posttrain.models.keywords import unwrap
from posttrain.models.loading import fallback_said, raised


class GraphedSteps:
    """A LeanDecoder (built with fixed_shape=True, on CUDA) whose steps replay one CUDA graph.

    Shapes: N rows, V vocabulary.
    """

    fixed_shape = True

    def __init__(self, decoder, model):
        decoder.attend_bucket = None  # the whole cache: one shape for every token of the decode
        self.decoder, self.model = decoder, model
        self.graph = None  # captured at the first step, after the prefill filled the cache
        self.eager = False

    def prefill(self, prompt_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.decoder.prefill(prompt_ids, positions)

    def keep_rows(self, rows: torch.Tensor) -> bool:
        return False  # a captured step keeps its rows

    def step(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N] ids, [N, 1] positions -> next-token logits [N, V] float32 (the graph's output buffer: overwritten by
        the next step)."""
        if self.graph is None and not self.eager:
            self._capture(token_ids, positions)
        if self.eager:
            return self.decoder.step(token_ids, positions)
        self.ids.copy_(token_ids)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.logits

    def _capture(self, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Warm the step up on a side stream (lazy initialisations, cuBLAS workspaces), then capture it. Both write
        at the cursor's position, which the first replay writes again: the cursor and the key mask are restored."""
        decoder = self.decoder
        self.ids, self.positions = token_ids.clone(), positions.clone()
        cursor, key_mask = decoder.cursor.clone(), decoder.key_mask.clone()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    decoder.step(self.ids, self.positions)
                    decoder.cursor.copy_(cursor)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = decoder.step(self.ids, self.positions)
            self.graph = graph
        except RuntimeError as err:
            self.eager = True
            fallback_said(unwrap(self.model), "cache_implementation='static' decodes at fixed shapes without a CUDA "
                          "graph", f"capturing its step raised {raised(err)}")
        decoder.cursor.copy_(cursor)
        decoder.key_mask.copy_(key_mask)
