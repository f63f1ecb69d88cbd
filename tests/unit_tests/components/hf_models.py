"""What the Hugging Face interop tests of every family share: our model of some args built
as a run builds it (meta device, then materialised and initialised), and logits of either
side without gradients."""

import torch

from torchtitan.models.llama3.model import Transformer


def build_ours(args) -> Transformer:
    """Llama 3's model (and the families on it) of ``args``, initialised, in eval mode."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.eval()


def logits(model, tokens: torch.Tensor, hf: bool = False) -> torch.Tensor:
    """``model``'s logits of ``tokens`` (``hf``: a ``transformers`` model's ``.logits``)."""
    with torch.no_grad():
        return model(tokens).logits if hf else model(tokens)
