import copy
import math

import pytest
import torch

from bitquilt import quantize
from bitquilt.data.windows import eval_windows
from bitquilt.eval import perplexity
from bitquilt.eval.precision import eval_precision
from bitquilt.isa import fast_bf16
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe


def test_perplexity_equals_transformers_loss(smollm):
    model, tok = smollm
    result = perplexity(model, tok, "wiki", seqlen=256, max_windows=3, progress=False)
    windows = eval_windows(tok, "wiki", 256, 3)
    with torch.no_grad():
        losses = [model(w.unsqueeze(0), labels=w.unsqueeze(0)).loss.item() for w in windows]
    assert result.n_windows == 3 and result.n_tokens == 768
    assert math.isclose(result.ppl, math.exp(sum(losses) / 3), rel_tol=1e-5)
    assert 5 < result.ppl < 60  # a real model on Wikipedia text, not noise


def test_bf16_evaluation_is_within_a_percent_and_leaves_the_model_as_it_was(smollm):
    """bf16 products (fp32 sums) shift a real model's perplexity by well under 1%, on the full-precision model and
    on a W4 quantization of it, and the fp32 result afterwards is bit-identical: nothing stays patched."""
    model, tok = smollm
    quantized = copy.deepcopy(model)
    quantize(quantized, Recipe("rtn", w_bits=4, group_size=128), None, progress=False)
    for m in (model, quantized):
        fp32 = perplexity(m, tok, "wiki", seqlen=256, max_windows=2, progress=False)
        bf16 = perplexity(m, tok, "wiki", seqlen=256, max_windows=2, progress=False, precision="bf16")
        assert (fp32.precision, bf16.precision) == ("fp32", "bf16")
        assert bf16.ppl != fp32.ppl and math.isclose(bf16.ppl, fp32.ppl, rel_tol=0.01)
        assert perplexity(m, tok, "wiki", seqlen=256, max_windows=2, progress=False).ppl == fp32.ppl
    assert not any("forward" in m.__dict__ for m in quantized.modules() if isinstance(m, QuantLinear))
    assert eval_precision("auto") == ("bf16" if fast_bf16() else "fp32")
    with pytest.raises(ValueError, match="choose auto, fp32, bf16"):
        eval_precision("fp16")
