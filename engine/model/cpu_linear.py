"""Linear layers on the CPU with each weight reordered once for oneDNN: a step of a few rows (a
decode batch, a prefill piece) then reads each weight once instead of repacking it every call."""

from __future__ import annotations

import torch

# The row count oneDNN lays the weights out for; any count runs. Chosen by a one-off timing, not
# a committed benchmark: this layout was as fast as one for 1 row from 1 to 128 rows.
HINT_ROWS = 64


class PrepackedLinear(torch.nn.Linear):
    """An nn.Linear (same weight and bias parameters, same state dict) whose forward on the CPU
    uses the weight's oneDNN layout, reordered again if the weight was changed in place."""

    packed: torch.Tensor
    packed_version: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.device.type != "cpu" or x.dtype != weight.dtype or x.requires_grad:
            return super().forward(x)
        if weight._version != self.packed_version:
            self.pack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def pack(self) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), HINT_ROWS)
        self.packed_version = self.weight._version


def available(model: torch.nn.Module) -> bool:
    """oneDNN is built in and the model's weights are float32 on the CPU (its bfloat16 path
    needs AVX512-BF16 or AMX, and is not measured)."""
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack_linears(model: torch.nn.Module) -> int:
    """Turn every nn.Linear of `model` into a PrepackedLinear in place (the parameters stay the
    module's: tied weights stay tied); the number turned. Each keeps a second, reordered copy of
    its weight: the linear layers' memory doubles."""
    if not available(model):
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = PrepackedLinear
            module.pack()  # type: ignore[operator]
            count += 1
    return count
