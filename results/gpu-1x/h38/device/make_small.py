"""Write the Qwen3-0.6B shape (its published config: hidden 1024, 28 layers, 16/8 heads, tied embeddings) with the
GPU kit's make_model.py (dummy weights: config and tokenizer only): usage `make_small.py OUT_DIR [--layers N]`."""
import sys

sys.path.insert(0, ".gpu/bin")
import make_model  # noqa: E402  (the kit's, carried in .gpu/bin)

make_model.SHAPES["qwen3-0.6b"] = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, max_window_layers=28,
    tie_word_embeddings=True)
sys.argv = ["make_model.py", "qwen3-0.6b", sys.argv[1], "--force", *sys.argv[2:]]  # e.g. --layers 8
sys.exit(make_model.main())
