"""
A GPT language model, small enough to read in one sitting.

Initialisation lives in init_weights(), separate from __init__, so a model built on the
meta device (no memory) and sharded first can be given exactly the weights a normally built
model gets: every parameter is drawn from its own generator seeded by (seed, parameter name),
so the weights depend on neither the world size, the backend nor the order of construction.
"""
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # bias in Linears and LayerNorms, like GPT-2
    activation_checkpointing: bool = False  # recompute each block's activations in backward


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None and config.block_size is not None
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: the embedding and the output projection are one parameter
        self.transformer.wte.weight = self.lm_head.weight

    def get_num_params(self, non_embedding=True):
        """Parameter count; position embeddings excluded by default (as in GPT-2 papers)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    @torch.no_grad()
    def init_weights(self, seed=0, weights=None):
        """Deterministic init: each parameter from a generator seeded by (seed, its name), or
        from `weights` (a full state dict, GPT-2's) when given.

        Works on plain tensors and on sharded DTensors: a DTensor receives its local piece of
        the full tensor, built one parameter at a time (never the whole model at once).
        """
        from torch.distributed.tensor import DTensor, distribute_tensor
        for name, p in self.named_parameters():
            full = weights[name] if weights is not None else self._initial_value(name, tuple(p.shape), seed)
            full = full.to(p.dtype)
            if isinstance(p, DTensor):
                # src_data_rank=None: every rank built the same full tensor, so no communication
                local = distribute_tensor(full.to(p.device), p.device_mesh, p.placements,
                                          src_data_rank=None).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(full)

    def _initial_value(self, name, shape, seed):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("bias"):
            return torch.zeros(shape)
        if ".ln_" in name:  # ln_1, ln_2, ln_f
            return torch.ones(shape)  # LayerNorm weight
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer)
        std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 0.02
        return torch.empty(shape).normal_(0.0, std, generator=gen)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of {t} > block_size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            if self.config.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.logits_and_loss(x, targets)

    def logits_and_loss(self, x, targets=None):
        """The last LayerNorm, the vocabulary projection and the loss: a method of its own so
        that a backend compiling block by block can compile this too (its logits are the
        largest activations of a GPT-2)."""
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # inference: only the last position
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, optimizer_class=torch.optim.AdamW):
        """AdamW (or a subclass: the sharded backends' steps the local shards) with weight decay on
        matrices only (not on biases and LayerNorm gains)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # fused: one kernel (and, on sharded DTensor parameters, one Python dispatch) per parameter
        # group, where foreach takes about ten and the per-parameter loop ten per parameter
        return optimizer_class(groups, lr=learning_rate, betas=betas, fused=True)

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops):
        """Model FLOPs utilisation (PaLM appendix B), or None where the peak is unknown."""
        if not peak_flops:
            return None
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * self.get_num_params() + 12 * L * H * Q * T
        return flops_per_token * T * fwdbwd_per_iter / dt / peak_flops

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, vocab_size=None):
        """Sample max_new_tokens after idx. vocab_size: draw only ids below it, the tokenizer's (a
        vocabulary padded for speed, as GPT-2's 50257 to 50304, has ids no tokenizer decodes)."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :vocab_size] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


GPT2_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def load_pretrained_gpt2(model_type):
    """OpenAI's GPT-2 weights through Hugging Face transformers (offline: from its cache, with
    HF_HUB_OFFLINE=1) -> (GPTConfig, full state dict). Any failure is a one-line ValueError."""
    if model_type not in GPT2_MODELS:
        raise ValueError(f"'{model_type}' is not one of OpenAI's GPT-2 models ({', '.join(GPT2_MODELS)})")
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise ValueError("needs Hugging Face's transformers: pip install transformers") from None
    try:
        hf = GPT2LMHeadModel.from_pretrained(model_type)
    except Exception as e:  # not downloadable, not in the cache offline, a damaged file
        offline = "; offline, transformers reads its cache (HF_HUB_OFFLINE=1, HF_HUB_CACHE names the folder)"
        raise ValueError(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
                         f"{offline if isinstance(e, OSError) else ''}") from e
    return from_hf_gpt2(hf)


def from_hf_gpt2(hf):
    """A transformers GPT2LMHeadModel -> (GPTConfig, state dict in this model's layout)."""
    c = hf.config
    config = GPTConfig(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, vocab_size=c.vocab_size,
                       block_size=c.n_positions, bias=True)
    # OpenAI's checkpoints store these as Conv1D (in, out): transpose to Linear (out, in)
    transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {k: (v.t() if k.endswith(transposed) else v) for k, v in hf.state_dict().items()
             if not k.endswith((".attn.masked_bias", ".attn.bias"))}  # (causal masks, in older releases)
    return config, state
