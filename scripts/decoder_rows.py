"""The decoder's last layer on the rows a loss reads, and nowhere else (--decoder-loss-rows).

A training step's loss reads the logits of the positions that predict an answer token: in the
pre-stage ~2 of a row's ~22 tokens, in the joint stage ~8 of ~198 (144 are visual tokens). Every
layer but the last must still run on all tokens (the next layer's keys and values read them), but
the last layer's output feeds only the final norm and the head. So the last layer here computes
keys and values for all tokens and the query, the attention output, the MLP and both residuals
for the read rows only; the other rows pass its input through, which nothing downstream reads.
Same loss and gradients up to GEMM summation order (the smoke test checks both against the
layer's own forward): the last layer is ~23 % of a 4-layer decoder's FLOPs.

Shapes: B rows, T tokens, H hidden, N read rows per row (the busiest row's count; a row with fewer
computes some unread rows, which are not written back)."""
from __future__ import annotations

import contextlib

import torch
from transformers.models.llama.modeling_llama import repeat_kv, rotate_half

IGNORE = -100


class LossRows:
    """Wraps a Llama-style decoder's last layer (input_layernorm, self_attn with q/k/v/o_proj,
    post_attention_layernorm, mlp). Outside `only(labels)` the layer runs as it is."""

    def __init__(self, decoder: torch.nn.Module):
        self.layer = decoder.layers[-1]
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (index [B, N], valid [B, N])
        self.layer.forward = self._forward

    def restore(self) -> None:
        del self.layer.forward  # the class's forward again

    @contextlib.contextmanager
    def only(self, labels: torch.Tensor):
        """labels [B, T], unshifted, IGNORE where no loss: position p is read when labels[:, p + 1] is a target."""
        read = torch.zeros_like(labels, dtype=torch.bool)
        read[:, :-1] = labels[:, 1:] != IGNORE
        counts = read.sum(1)
        if int(counts.min()) == 0:
            raise ValueError("decoder loss rows: a row has no target token (labels all ignored)")
        n = int(counts.max())
        # Read positions first, in order (a stable sort of 0/1 keys), then unread ones as filler.
        order = torch.sort((~read).to(torch.int8), dim=1, stable=True).indices
        self.rows = (order[:, :n], torch.arange(n).unsqueeze(0) < counts.unsqueeze(1))
        try:
            yield self
        finally:
            self.rows = None

    def _forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids=None, past_key_values=None, use_cache=False, position_embeddings=None, **kwargs):
        layer = self.layer
        if self.rows is None:
            return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                       past_key_values=past_key_values, use_cache=use_cache,
                                       position_embeddings=position_embeddings, **kwargs)
        if position_embeddings is None or (past_key_values is not None
                                           and past_key_values.get_seq_length(layer.self_attn.layer_idx) > 0):
            raise RuntimeError("decoder loss rows: a training forward only (rotary embeddings given, no cached tokens)")
        index, valid = self.rows
        attn = layer.self_attn
        B, T, H = hidden_states.shape
        if index.size(0) != B or int(index.max()) >= T:
            raise RuntimeError(f"decoder loss rows: rows for [{index.size(0)}, <= {int(index.max()) + 1}] tokens, "
                               f"got hidden states [{B}, {T}]")
        N, hd = index.size(1), attn.head_dim
        normed = layer.input_layernorm(hidden_states)
        cos, sin = (t.expand(B, -1, -1) for t in position_embeddings)  # [B or 1, T, hd] -> [B, T, hd]
        keys = attn.k_proj(normed).view(B, T, -1, hd).transpose(1, 2)  # [B, kv heads, T, hd]
        values = attn.v_proj(normed).view(B, T, -1, hd).transpose(1, 2)
        keys = keys * cos.unsqueeze(1) + rotate_half(keys) * sin.unsqueeze(1)
        if past_key_values is not None:  # HF fills a fresh cache when config.use_cache is on; keep it whole
            keys, values = past_key_values.update(keys, values, attn.layer_idx)
        take = lambda t: t.gather(1, index.unsqueeze(-1).expand(-1, -1, t.size(-1)))  # [B, T, C] -> [B, N, C]
        residual = take(hidden_states)
        query = attn.q_proj(take(normed)).view(B, N, -1, hd).transpose(1, 2)  # [B, heads, N, hd]
        query = query * take(cos).unsqueeze(1) + rotate_half(query) * take(sin).unsqueeze(1)
        keys, values = repeat_kv(keys, attn.num_key_value_groups), repeat_kv(values, attn.num_key_value_groups)
        scores = torch.matmul(query, keys.transpose(2, 3)) * attn.scaling  # [B, heads, N, T]
        if attention_mask is None:  # causal, no padding
            scores = scores.masked_fill(torch.arange(T).view(1, 1, 1, T) > index.view(B, 1, N, 1), float("-inf"))
        else:
            if attention_mask.dim() != 4:
                raise RuntimeError(f"decoder loss rows: expected a 4-D attention mask, got {attention_mask.dim()}-D")
            mask = attention_mask[..., :T].gather(
                2, index.view(B, 1, N, 1).expand(-1, attention_mask.size(1), -1, T))
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, values).transpose(1, 2).reshape(B, N, -1)
        out = residual + attn.o_proj(out)
        out = out + layer.mlp(layer.post_attention_layernorm(out))
        b = torch.arange(B).unsqueeze(1).expand(-1, N)[valid]
        return hidden_states.index_put((b, index[valid]), out[valid])
