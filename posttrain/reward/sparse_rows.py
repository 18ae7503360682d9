"""AdamW for the input embedding row by row: the same update as torch's dense AdamW, on the rows that move, with
moments kept for those rows only.

A batch looks up a few rows of the input embedding (a few dozen of 152k in the reward benchmark), yet its dense
gradient is the whole [V, H] table, zeroed and scattered into every step, and AdamW reads and writes every row of the
weight and of its two moments, which take twice the weight's memory. With weight decay 0, AdamW leaves a row whose
gradient and moments are all zero exactly as it is (its moments stay 0, its update is 0 / (0 + eps)), so updating
only the rows that ever had a gradient gives the dense update. Here the embedding gives a sparse gradient
(nn.Embedding's sparse=True); its norm joins the other gradients' in the clipping; the optimizer steps every other
parameter, and this module steps the embedding's touched rows, whose moments it keeps compact (`rows`, `exp_avg`,
`exp_avg_sq` below) beside the optimizer's step count (optimizer.state[weight]["step"]). The optimizer's state_dict
shows the moments whole, as torch's AdamW keeps them (exp_avg, exp_avg_sq [V, H]), and its load_state_dict takes them
so (hooks on the optimizer), so a checkpoint reads back into either path.

Used where that is exact and nothing else reads the embedding's gradient as a dense tensor: one process (no DDP,
FSDP or DeepSpeed), the optimizer posttrain built (torch's AdamW or Adam, weight decay 0 for the embedding, no
amsgrad), no fp16 loss scaling, a plain nn.Embedding whose weight is shared with no other layer (an output layer tied
to it gets a dense gradient anyway).

    slot        long [V]     each row's place in the compact moments, -1 for a row never touched
    rows        long [R]     the row of each place in use
    exp_avg     float [C, H] AdamW's moments of rows[i] in row i (C >= R: room to grow)
    exp_avg_sq  float [C, H]
"""

import math

import torch

from posttrain.training.update import Update


class SparseRows:
    def __init__(self, embedding: torch.nn.Embedding, optimizer: torch.optim.Optimizer):
        self.embedding, self.weight = embedding, embedding.weight
        self.optimizer = optimizer
        vocab, width = self.weight.shape
        self.slot = torch.full((vocab,), -1, dtype=torch.long, device=self.weight.device)
        self.rows = torch.zeros(0, dtype=torch.long, device=self.weight.device)
        self.exp_avg = self.weight.new_zeros((0, width))
        self.exp_avg_sq = self.weight.new_zeros((0, width))
        self.finite = True  # whether the rows the last update wrote are finite
        self._hooks = [optimizer.register_state_dict_post_hook(self._whole_moments),
                       optimizer.register_load_state_dict_post_hook(lambda opt: self._take_moments())]
        self._take_moments()  # a state already in the optimizer (loaded before this was built)
        embedding.sparse = True

    @classmethod
    def where_exact(cls, policy, optimizer, *, one_process: bool, fp16: bool, optimizer_built_here: bool):
        """The row-wise update of `policy`'s input embedding under `optimizer`, where it is exact (the module's
        docstring), else None. `one_process`: one process and the policy unwrapped; `optimizer_built_here`: the
        optimizer is the one posttrain built from the config."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        if not one_process or fp16 or not optimizer_built_here:
            return None
        if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
            return None
        embedding = policy.get_input_embeddings() if hasattr(policy, "get_input_embeddings") else None
        if type(embedding) is not torch.nn.Embedding or not embedding.weight.requires_grad or embedding.max_norm:
            return None
        output = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
        if output is not None and getattr(output, "weight", None) is embedding.weight:
            return None
        groups = [g for g in optimizer.param_groups if any(p is embedding.weight for p in g["params"])]
        if len(groups) != 1 or groups[0]["weight_decay"] != 0 or groups[0].get("amsgrad") or \
                groups[0].get("maximize") or groups[0].get("capturable") or groups[0].get("differentiable"):
            return None
        return cls(embedding, optimizer)

    def serves(self, optimizer) -> bool:
        """Whether `optimizer` (accelerate's wrapper or not) is the one this update was built for."""
        return getattr(optimizer, "optimizer", optimizer) is self.optimizer

    def release(self) -> None:
        """Back to the dense gradient (the optimizer was replaced): this step's sparse gradient made dense, the
        moments whole in the old optimizer's state, its hooks removed."""
        self.embedding.sparse = False
        if self.weight.grad is not None and self.weight.grad.is_sparse:
            self.weight.grad = self.weight.grad.to_dense()
        for hook in self._hooks:
            hook.remove()
        state = self.optimizer.state[self.weight]
        if "step" in state:
            state["exp_avg"], state["exp_avg_sq"] = self._whole(self.exp_avg), self._whole(self.exp_avg_sq)

    # ------------------------------------------------------------------ clipping

    def clip(self, parameters, max_norm: float) -> float:
        """Clip every gradient (the embedding's sparse one among them) to a total norm of `max_norm` (<= 0: no
        clipping), as torch's clip_grad_norm_ does; returns the norm before clipping."""
        dense = [p for p in parameters if p.grad is not None and p is not self.weight]
        grad = self.weight.grad
        squares = torch.zeros((), dtype=torch.float32)
        if dense:
            squares = torch.nn.utils.get_total_norm([p.grad for p in dense], 2.0).float() ** 2
        if grad is not None:
            grad = self.weight.grad = grad.coalesce()
            squares = squares + grad.values().float().pow(2).sum()
        total = squares.sqrt()
        if max_norm > 0:
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            if dense:
                torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total)
            if grad is not None:
                # the indices are the coalesced gradient's own: valid, so torch's check (and its warning) is skipped
                self.weight.grad = torch.sparse_coo_tensor(grad.indices(), grad.values() * coefficient.to(
                    grad.dtype), grad.shape, is_coalesced=True, check_invariants=False)
        return float(total)

    # ------------------------------------------------------------------ the update

    def step(self, optimizer_step):
        """`optimizer_step()` for every other parameter, then the embedding's active rows (AdamW's update)."""
        grad = self.weight.grad
        self.weight.grad = None  # the optimizer skips a parameter without a gradient
        try:
            result = optimizer_step()
        finally:
            self.weight.grad = grad
        if grad is not None:
            self._adamw_rows(grad.coalesce())
        return result

    @property
    def group(self) -> dict:
        """The embedding's parameter group, looked up at each step (loading a checkpoint replaces the groups)."""
        return next(g for g in self.optimizer.param_groups if any(p is self.weight for p in g["params"]))

    # ------------------------------------------------------------------ the moments, compact and whole

    def _whole(self, compact: torch.Tensor) -> torch.Tensor:
        """[V, H] a moment as torch's AdamW keeps it: the compact rows in their places, 0 elsewhere."""
        whole = torch.zeros_like(self.weight, memory_format=torch.preserve_format)
        return whole.index_copy_(0, self.rows, compact[:len(self.rows)])

    def _whole_moments(self, optimizer, state_dict: dict) -> dict:
        """The optimizer's state_dict with the embedding's moments whole (a state_dict post hook)."""
        if len(self.rows) == 0:
            return state_dict
        index = next(i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])
                     if p is self.weight)
        entry = state_dict["state"].get(index)
        if entry is not None:
            state_dict["state"][index] = {**entry, "exp_avg": self._whole(self.exp_avg),
                                          "exp_avg_sq": self._whole(self.exp_avg_sq)}
        return state_dict

    @torch.no_grad()
    def _take_moments(self) -> None:
        """The compact moments from the optimizer's state (a loaded checkpoint's): its whole moments' rows where
        either is not zero, taken out of the state; none where it holds none."""
        state = self.optimizer.state.get(self.weight, {})
        width = self.weight.size(1)
        exp_avg = state.pop("exp_avg", self.weight.new_zeros((0, width)))
        exp_avg_sq = state.pop("exp_avg_sq", self.weight.new_zeros((0, width)))
        self.rows = ((exp_avg != 0).any(1) | (exp_avg_sq != 0).any(1)).nonzero().squeeze(1)
        self.slot.fill_(-1)
        self.slot[self.rows] = torch.arange(len(self.rows), device=self.slot.device)
        self.exp_avg, self.exp_avg_sq = exp_avg.index_select(0, self.rows), exp_avg_sq.index_select(0, self.rows)

    def _place(self, touched: torch.Tensor) -> None:
        """Places in the compact moments for the rows in `touched` that have none (capacity grown by doubling)."""
        new = touched[self.slot[touched] < 0]
        if len(new) == 0:
            return
        used = len(self.rows)
        if used + len(new) > len(self.exp_avg):
            capacity = max(used + len(new), 2 * len(self.exp_avg))
            for name in ("exp_avg", "exp_avg_sq"):
                grown = self.weight.new_zeros((capacity, self.weight.size(1)))
                grown[:used] = getattr(self, name)[:used]
                setattr(self, name, grown)
        self.slot[new] = torch.arange(used, used + len(new), device=self.slot.device)
        self.rows = torch.cat([self.rows, new])

    @torch.no_grad()
    def _adamw_rows(self, grad: torch.Tensor) -> None:
        state, group = self.optimizer.state[self.weight], self.group
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        touched = grad.indices()[0]
        self._place(touched)
        used, weight = len(self.rows), self.weight.data
        # the arithmetic in float32 for 16-bit weights, the moments stored in the weight's dtype, as torch's fused
        # AdamW (the default optimizer) computes (in float16, eps=1e-8 is 0 and an untouched element's 0 / 0 is NaN)
        math_dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        dense = torch.zeros((used, weight.size(1)), dtype=math_dtype, device=grad.device)  # [R, H]
        dense[self.slot[touched]] = grad.values().to(math_dtype)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = float(state["step"])
        exp_avg = self.exp_avg[:used].to(math_dtype).lerp_(dense, 1 - beta1)
        exp_avg_sq = self.exp_avg_sq[:used].to(math_dtype).mul_(beta2).addcmul_(dense, dense, value=1 - beta2)
        self.exp_avg[:used], self.exp_avg_sq[:used] = exp_avg, exp_avg_sq  # in place where the dtype is the same
        lr = float(group["lr"])
        step_size = lr / (1 - beta1 ** step)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
        rows = weight.index_select(0, self.rows).to(math_dtype)
        if abs(step_size) < torch.finfo(math_dtype).max:
            updated = rows.addcdiv_(exp_avg, denom, value=-step_size)
        else:  # a step size beyond the dtype (a huge learning rate): the rows go non-finite, and the run stops
            updated = rows - exp_avg / denom * torch.tensor(step_size, dtype=math_dtype)
        updated = updated.to(weight.dtype)
        self.finite = bool(torch.isfinite(updated).all())  # the only rows that changed: the weight's check
        weight.index_copy_(0, self.rows, updated)


class RowwiseEmbeddingUpdate(Update):
    """The reward trainer's update: the dense one for every parameter but the input embedding, whose touched rows
    `rows` steps; the dense one alone once the optimizer is replaced (the rows' moments handed back to it)."""

    def __init__(self, sharding, rows: SparseRows):
        super().__init__(sharding)
        self.rows = rows

    def _serving(self, optimizer) -> SparseRows | None:
        if self.rows is not None and not self.rows.serves(optimizer):  # an optimizer put in after construction
            self.rows.release()
            self.rows = None
        return self.rows

    def clip(self, model, optimizer, max_norm: float) -> float | None:
        rows = self._serving(optimizer)
        if rows is None:
            return super().clip(model, optimizer, max_norm)
        return rows.clip([p for p in model.parameters() if p.requires_grad], max_norm)

    def step(self, model, optimizer) -> float | None:
        rows = self._serving(optimizer)
        if rows is None:
            return super().step(model, optimizer)
        return rows.step(lambda: super(RowwiseEmbeddingUpdate, self).step(model, optimizer))

    def nonfinite_weight(self, policy) -> str | None:
        """The embedding's updated rows were checked as they were written; every other weight here."""
        rows = self.rows
        if rows is None:
            return super().nonfinite_weight(policy)
        finite, name = self.sharding.all_finite(policy, skip=rows.weight)
        if finite and not rows.finite:
            return next(n for n, p in policy.named_parameters() if p is rows.weight)
        return None if finite else name
