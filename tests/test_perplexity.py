import math

import torch

from bitquilt.data.windows import eval_windows
from bitquilt.eval import perplexity


def test_perplexity_equals_transformers_loss(smollm):
    model, tok = smollm
    result = perplexity(model, tok, "wiki", seqlen=256, max_windows=3, progress=False)
    windows = eval_windows(tok, "wiki", 256, 3)
    with torch.no_grad():
        losses = [model(w.unsqueeze(0), labels=w.unsqueeze(0)).loss.item() for w in windows]
    assert result.n_windows == 3 and result.n_tokens == 768
    assert math.isclose(result.ppl, math.exp(sum(losses) / 3), rel_tol=1e-5)
    assert 5 < result.ppl < 60  # a real model on Wikipedia text, not noise
