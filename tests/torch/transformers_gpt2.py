"""The transformers side of the GPT-2 round trip (tests/torch/test_safetensors.cpp).

make DIR   a GPT2LMHeadModel of random weights, save_pretrained to DIR/hf, and its
           logits on the test tokens to DIR/hf_logits.safetensors
check DIR  GPT2LMHeadModel.from_pretrained(DIR) (what accel saved, with the
           config copied beside it): its logits on the test tokens against
           DIR/accel_logits.safetensors; prints the largest difference
No hub access: the model is built from a config.
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

logging.set_verbosity_error()


def config():
    # The C++ test's gpt::Config{vocab 64, context 16, width 32, heads 4, layers 2}.
    return GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, activation_function="gelu",
                      tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=0, eos_token_id=0)


def tokens():
    return (torch.arange(2 * 16).reshape(2, 16) * 7 + 3) % 64


def logits(model):
    model.eval()
    with torch.no_grad():
        return model(tokens()).logits.contiguous()


def main():
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "make":
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config())
        model.save_pretrained(root + "/hf", safe_serialization=True)
        save_file({"tokens": tokens(), "logits": logits(model)}, root + "/hf_logits.safetensors")
    else:
        model, info = GPT2LMHeadModel.from_pretrained(root, attn_implementation="eager", output_loading_info=True)
        unmatched = {k: v for k, v in info.items() if v}
        assert not unmatched, unmatched
        expected = load_file(root + "/accel_logits.safetensors")["logits"]
        print(f"{(logits(model) - expected).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
