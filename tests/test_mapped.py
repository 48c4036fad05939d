"""A loaded model's packed tensors are views of its mapped file, given back once a kernel layout serves them."""

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bitquilt import kernels, mapped
from bitquilt.api import quantize
from bitquilt.io import WEIGHTS_NAME
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe
from bitquilt.resources import resident_bytes
from tests.conftest import reload_bit_exact

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")


@pytest.fixture
def mapped_bytes(tmp_path):
    data = torch.randint(0, 256, (64 * mapped.mmap.PAGESIZE,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    return path, data


@linux_only
def test_release_drops_the_pages_and_keeps_the_data(mapped_bytes):
    path, data = mapped_bytes
    mm = mapped.map_file(path)
    view = mapped.tensor_view(mm, 8, data.numel() - 8, torch.uint8, (data.numel() - 8,))
    assert torch.equal(view, data[8:])  # touches every page
    assert resident_bytes(path) >= data.numel() - mapped.mmap.PAGESIZE
    released = mapped.release([view])
    assert released == data.numel() - mapped.mmap.PAGESIZE  # whole pages inside the view only: not the first
    assert resident_bytes(path) <= mapped.mmap.PAGESIZE
    assert torch.equal(view, data[8:])  # read back from the file


@linux_only
def test_releasing_some_rows_keeps_the_others(mapped_bytes, monkeypatch):
    path, data = mapped_bytes
    mm = mapped.map_file(path)
    rows = mapped.tensor_view(mm, 0, data.numel(), torch.uint8, (64, mapped.mmap.PAGESIZE))
    assert torch.equal(rows, data.view(64, -1))
    assert mapped.release([rows[:16]]) == 16 * mapped.mmap.PAGESIZE  # a contiguous view: its own pages only
    assert resident_bytes(path) >= 48 * mapped.mmap.PAGESIZE
    trims = []
    monkeypatch.setattr(mapped, "return_free_memory", lambda: trims.append(1))
    for i in range(2 * mapped.TRIM_EVERY):  # a layout built chunk by chunk: pages each chunk, the heap every few
        mapped.release_chunk(i, [rows[16 + i:17 + i]])
    assert len(trims) == 2
    assert resident_bytes(path) <= (48 - 2 * mapped.TRIM_EVERY) * mapped.mmap.PAGESIZE
    assert torch.equal(rows, data.view(64, -1))


def test_release_leaves_other_tensors_alone(mapped_bytes):
    path, data = mapped_bytes
    mm = mapped.map_file(path)
    small = mapped.tensor_view(mm, 100, 1000, torch.uint8, (1000,))  # inside one page, shared with neighbours
    assert mapped.release([torch.ones(1 << 16), small, torch.empty(0)]) == 0
    assert torch.equal(small, data[100:1100])


def test_misaligned_views_are_copies(mapped_bytes):
    path, data = mapped_bytes
    mm = mapped.map_file(path)
    t = mapped.tensor_view(mm, 2, 4 * 16, torch.float32, (4, 4))
    assert t.data_ptr() % 4 == 0
    assert torch.equal(t.view(torch.uint8).reshape(-1), data[2:66])
    assert mapped.release([t]) == 0


@linux_only
def test_a_loaded_model_keeps_one_copy_of_its_linears(tmp_path):
    """Loaded, the packed linears are views of the file; once the kernels have built their layouts (first forward)
    the file's pages are given back, and the outputs stay bit-identical to the model that was saved."""
    config = LlamaConfig(vocab_size=320, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()  # 512 x 512 linears: 32 pages of 4-bit codes and more
    quantize(model, Recipe("rtn", w_bits=4, group_size=64), None, progress=False)
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(2))
    loaded = reload_bit_exact(model, ids, tmp_path / "q")  # the first forward builds the layouts
    linears = [m for m in loaded.modules() if isinstance(m, QuantLinear)]
    assert all(mapped._mapping_of(m.fmt.qweight) is not None for m in linears)
    assert all(kernels.kernel_layout_bytes(m.fmt) > 0 for m in linears)
    packed = sum(t.numel() * t.element_size() for m in linears for t in m.fmt.tensors().values())
    # what stays: the pages each tensor shares with its neighbours and those the kernel maps around a fault
    # (measured 17% of these small tensors; on qwen2.5-1.5b only the LM head, which its kernel reads in place)
    assert resident_bytes(tmp_path / "q" / WEIGHTS_NAME) < packed / 4
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@linux_only
@pytest.mark.parametrize("tied", [False, True])
def test_an_embedding_gives_its_table_back_after_lookups_unless_a_head_reads_it(tmp_path, tied):
    """A lookup maps far more of the table than its rows (fault-around, large folios); an embedding whose table no
    LM head reads in place gives those pages back after each lookup, with the rows unchanged."""
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()  # 8-bit table: 2048 × 256 bytes, 128 pages
    quantize(model, Recipe("rtn", w_bits=4, group_size=64, head_bits=8, head_group_size=64), None, progress=False)
    ids = torch.randint(0, 2048, (1, 64), generator=torch.Generator().manual_seed(3))
    loaded = reload_bit_exact(model, ids, tmp_path / "q")
    table = loaded.get_input_embeddings()
    assert table.returns_pages is not tied
    table.returns_pages = False
    rows = table(ids)
    mapped_after_lookup = resident_bytes(tmp_path / "q" / WEIGHTS_NAME)
    table.returns_pages = True
    assert torch.equal(table(ids), rows)
    given_back = mapped_after_lookup - resident_bytes(tmp_path / "q" / WEIGHTS_NAME)
    assert given_back >= 2048 * 256 // 2  # 64 rows spread over the table mapped at least half of it


@linux_only
@pytest.mark.parametrize("runtime", ["transformers", "bitquilt"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_full_precision_table_is_mapped_and_given_back_unless_a_head_reads_it(tmp_path, tied, runtime):
    """An unquantized embedding table (the LM head kept in full precision too) loads as a view of the file, its
    pages given back after each lookup (qwen2.5-1.5b's fp32 table is 933 MB of which a prompt reads a few rows);
    tied to the head, which reads it whole every step, it is read into memory as before. Same logits either way."""
    from bitquilt.io import load_quantized

    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()  # fp32 table: 2048 × 256 × 4 bytes, 512 pages
    quantize(model, Recipe("rtn", w_bits=4, group_size=64), None, progress=False)
    ids = torch.randint(0, 2048, (1, 64), generator=torch.Generator().manual_seed(3))
    reload_bit_exact(model, ids, tmp_path / "q")
    loaded, _ = load_quantized(tmp_path / "q", runtime)
    table = loaded.model.embed_tokens.weight
    assert (mapped._mapping_of(table) is not None) is not tied
    with torch.no_grad():
        logits = loaded(ids) if runtime == "bitquilt" else loaded(ids).logits
        assert torch.allclose(logits[0], model(ids).logits[0], atol=1e-5)
    if not tied:  # 64 looked-up rows spread over the table; their pages are back after the call
        assert resident_bytes(tmp_path / "q" / WEIGHTS_NAME) < table.numel() * 4 // 8
