"""LoRA's targets (model.use_peft): which linear layers of each decoder layer get an adapter, read
from model.lora_target_modules as peft matches them, and what those adapters add to a trainer's
parameters and activations.

The decoder layer's paths are model.layers.N.self_attn.{q,k,v,o}_proj and
model.layers.N.mlp.{gate,up,down}_proj (Llama/Qwen/Mistral): None is peft's default for these
models (q_proj and v_proj), "all-linear" all seven. On a mixture of experts, transformers 5 fuses the
experts into 3-D parameters, and peft converts the targets that reach them (peft_converted_targets):
the stacks, and with "all-linear" the router, are adapted as parameters. An adapter on lm_head is not counted
(r x (hidden + vocabulary): a few MB). Standard library only: `hpcrl render` checks the targets
against the model on the login node (hpcrl.login.inputs).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from hpcrl.job.model_shape import ModelShape

# The linear layers of a Llama/Qwen/Mistral decoder layer, and the submodule each is in (a module
# path is model.layers.N.<submodule>.<name>); peft's default targets for these models.
DECODER_LINEARS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                   "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")
ALL_LINEAR = "all-linear"


def lora_target_matches(targets: str | tuple[str, ...] | list[str], path: str) -> bool:
    """peft's rule for whether model.lora_target_modules names the module at `path`: a name
    matches a path that is it or ends with "." + it; one string is a regular expression that must
    match the whole path ("all-linear" is not handled here)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, path) is not None
    return any(path == name or path.endswith("." + name) for name in targets)


def decoder_linear_path(layer: int, name: str) -> str:
    return f"model.layers.{layer}.{DECODER_LINEARS[name]}.{name}"


# The linear layers that share one input tensor (the attention norm's output, the attention's
# output, the MLP norm's output, the MLP's product): the full fine-tuning count keeps each once.
_SHARED_INPUT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}


# transformers 5's fused expert stacks of a mixture-of-experts layer (Qwen2/3-MoE, Mixtral, ...):
# name -> (in_features, out_features) from the hidden size and an expert's intermediate size.
EXPERT_STACKS = {"mlp.experts.gate_up_proj": lambda h, i: (h, 2 * i), "mlp.experts.down_proj": lambda h, i: (i, h)}


# peft's conversion of a target list for transformers 5's fused experts: the expert linears a name
# reached in transformers 4 -> the stack that holds them; gate_proj and up_proj together give
# gate_up_proj an adapter of twice the rank.
CONVERTED_STACKS = {"mlp.experts.gate_up_proj": ("gate_proj", "up_proj"), "mlp.experts.down_proj": ("down_proj",)}

# The mixture-of-experts model types for which peft converts model.lora_target_modules (a list,
# "all-linear" or a regular expression) to the fused stacks: those of transformers' conversion table
# whose pattern peft maps (peft.utils.transformers_weight_conversion; tests/compute/train/
# test_lora_experts.py holds this equal to the installed tables), by family. Each family's
# transformers-4 names of an expert's gate, up and down projections; the router (mlp.gate) is
# adapted as its weight parameter where the name "gate", "all-linear" or the expression reaches it.
PEFT_MOE_EXPERT_NAMES = {"qwen2_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
PEFT_MOE_FAMILIES = {
    **dict.fromkeys(("afmoe", "cohere2_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "ernie4_5_moe",
                     "exaone_moe", "flex_olmo", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm_moe_dsa",
                     "hunyuan_v1_moe", "longcat_flash", "mellum", "olmoe", "qwen3_moe", "qwen3_next",
                     "qwen3_omni_moe", "qwen3_omni_moe_thinker", "solar_open"), "qwen2_moe"),
    **dict.fromkeys(("minimax", "minimax_m2", "mixtral"), "mixtral"),
}
ROUTER_PARAMETER = "gate.weight"       # the name peft's converted config gives the router's weight


def peft_converted_targets(shape: ModelShape, targets) -> tuple[frozenset[str], bool]:
    """What peft's conversion of model.lora_target_modules reaches on this model: the expert
    projections, by their Llama names (CONVERTED_STACKS' terms), and whether the router. Nothing on a
    dense model, or a mixture of experts peft does not convert (PEFT_MOE_FAMILIES)."""
    family = PEFT_MOE_FAMILIES.get(shape.model_type) if shape.experts else None
    if family is None or targets is None:
        return frozenset(), False
    names = dict(zip(PEFT_MOE_EXPERT_NAMES[family], ("gate_proj", "up_proj", "down_proj")))
    if targets == ALL_LINEAR:
        return frozenset(names.values()), True
    if isinstance(targets, str):
        # peft probes each transformers-4 expert path at the stack's container against the expression
        return (frozenset(llama for old, llama in names.items()
                          if re.fullmatch(targets, f"model.layers.0.mlp.experts.{old}")),
                re.fullmatch(targets, "model.layers.0.mlp.gate") is not None)
    return frozenset(llama for old, llama in names.items() if old in targets), "gate" in targets


def converted_parameter_names(shape: ModelShape, targets) -> list[str]:
    """The parameters peft's conversion of model.lora_target_modules adapts on this model, as its
    converted config names them (down_proj, gate.weight, gate_up_proj)."""
    reached, router = peft_converted_targets(shape, targets)
    stacks = [stack.rsplit(".", 1)[-1] for stack, linears in CONVERTED_STACKS.items() if set(linears) <= reached]
    return sorted(stacks + ([ROUTER_PARAMETER] if router else []))


def converted_dropout_error(dropout: float, names) -> str:
    """model.lora_dropout with a model.lora_target_modules that peft converts to parameters: what the
    login node (hpcrl.login.inputs) and the job (hpcrl.compute.train.lora) both say."""
    return (f"model.lora_dropout: {dropout}: model.lora_target_modules reaches parameters of this "
            f"mixture-of-experts model ({', '.join(names)}: its fused expert stacks or router), which peft adapts "
            f"without dropout; set it to 0")


def expert_stacks(shape: ModelShape, parameters: tuple[str, ...],
                  reached: frozenset[str] = frozenset()) -> tuple[tuple[int, int, int, int, int], ...]:
    """(experts, in_features, out_features, experts per token, rank factor) of each expert stack
    adapted: named in model.lora_target_parameters as peft matches a name (the stack's path is it or
    ends with it), or reached by the expert linears' names of a lora_target_modules list (``reached``:
    peft converts them, CONVERTED_STACKS). Names of other parameters are not counted (their shapes
    are not known here)."""
    if not shape.experts:
        return ()
    out = []
    for stack, size in EXPERT_STACKS.items():
        linears = CONVERTED_STACKS[stack]
        converted = set(linears) <= reached
        if converted or lora_target_matches(tuple(parameters), f"model.layers.0.{stack}"):
            out.append((shape.experts, *size(shape.hidden_size, shape.expert_intermediate), shape.experts_per_token,
                        len(linears) if converted else 1))
    return tuple(out)


# model.lora_modules_to_save: the modules a copy of which may train beside the adapters.
LORA_MODULES_TO_SAVE = ("lm_head", "embed_tokens")


def tied_copy_error(names) -> str:
    """model.lora_modules_to_save on a model whose head is its embedding matrix: what the login node
    (hpcrl.login.lora_inputs) and the job (hpcrl.compute.train.lora) both say."""
    return (f"model.lora_modules_to_save: {', '.join(names)}: the head is tied to the input embeddings in this "
            f"model, and a trained copy would untie them in the engines")


class LoraTargets(NamedTuple):
    """The linear layers LoRA adapts in each decoder layer, with the adapters' rank and dropout."""
    r: int
    dropout: float
    features: tuple[tuple[str, int, int], ...]          # (name, in_features, out_features) of DECODER_LINEARS
    layers: tuple[frozenset[str], ...]                   # per decoder layer: the names of its adapted linears
    dora: bool = False
    saved_params: int = 0           # model.lora_modules_to_save: the trained copies' parameters
    # Adapted fused expert stacks, in every decoder layer: (experts, in_features, out_features,
    # experts per token, rank factor) of each (expert_stacks).
    stacks: tuple[tuple[int, int, int, int, int], ...] = ()
    # The router's (in_features, out_features) where peft adapts its weight in every decoder layer.
    router: tuple[int, int] | tuple[()] = ()

    @classmethod
    def of(cls, shape: ModelShape, targets, r: int, dropout: float = 0.0, dora: bool = False,
           modules_to_save: tuple[str, ...] = (), parameters: tuple[str, ...] = ()) -> "LoraTargets":
        """From model.lora_target_modules (None: peft's default, q_proj and v_proj),
        model.lora_modules_to_save (lm_head, embed_tokens: vocabulary x hidden each) and
        model.lora_target_parameters (counted where they name transformers' fused expert stacks,
        EXPERT_STACKS). On a mixture-of-experts model the MLP's names are no linear layers (transformers
        5 fuses the experts): where peft converts the targets (peft_converted_targets), the expert
        projections they reach adapt the stacks, and "all-linear" adapts the router too."""
        converted, router = peft_converted_targets(shape, targets)
        if targets is None:
            targets = PEFT_DEFAULT_TARGETS
        elif targets == ALL_LINEAR:
            targets = tuple(DECODER_LINEARS)
        features = tuple((name, fin, fout) for name, (fin, fout) in shape.linear_features().items())
        layers = [frozenset(name for name in DECODER_LINEARS
                            if lora_target_matches(targets, decoder_linear_path(i, name)))
                  for i in range(shape.num_layers)]
        if shape.experts:
            mlp = frozenset(n for n, group in DECODER_LINEARS.items() if group == "mlp")
            layers = [adapted - mlp for adapted in layers]
        return cls(r, dropout, features, tuple(layers), dora,
                   len(set(modules_to_save) & set(LORA_MODULES_TO_SAVE)) * shape.vocab_size * shape.hidden_size,
                   expert_stacks(shape, parameters, converted),
                   (shape.hidden_size, shape.experts) if router else ())

    def layer_params(self, layer: int) -> int:
        """The adapters' parameters in one decoder layer (with DoRA, a magnitude per output row too;
        on an expert stack, r x (in + out) per expert; on the router, r x (in + out))."""
        adapted = self.layers[layer]
        return (sum(self.r * (fin + fout) + (fout if self.dora else 0) for name, fin, fout in self.features
                    if name in adapted)
                + sum(self.r * factor * experts * (fin + fout) for experts, fin, fout, _, factor in self.stacks)
                + self.r * sum(self.router))

    def stack_bytes(self, compute_bytes: int) -> int:
        """One decoder layer's adapted expert stacks merged (peft's ParamWrapper computes W + s B A for
        the whole stack in the forward, and the backward keeps it, in the compute dtype)."""
        return compute_bytes * sum(experts * fin * fout for experts, fin, fout, *_ in self.stacks)

    def dora_peak_bytes(self, compute_bytes: int) -> int:
        """DoRA's forward of one adapted linear layer, freed before the next: peft's B A as a weight
        (lora_B(lora_A(identity)): the in x in identity, the in x out product), then s B A and W + s B A,
        whose row norms it divides by (detached: nothing of it is kept for the backward), in the
        compute dtype; the largest adapted layer's. 0 without DoRA."""
        adapted = set().union(*self.layers) if self.dora else set()
        return compute_bytes * max((fin * fin + 3 * fin * fout for name, fin, fout in self.features
                                    if name in adapted), default=0)

    @property
    def params(self) -> int:
        """Every adapter's parameters: r x (in_features + out_features) per adapted linear layer."""
        return sum(self.layer_params(i) for i in range(len(self.layers)))

    def layer_activation_bytes(self, layer: int, compute_bytes: int) -> int:
        """What one decoder layer keeps for the backward per token with LoRA, less what it keeps
        in full fine-tuning (hpcrl.job.memory.layer_activation_bytes; may be negative). A frozen
        linear layer keeps no input (its weight needs no gradient): an input tensor stays only where
        an adapter's lora_A takes it as it is (lora_dropout 0). With dropout, each adapter keeps its dropped input
        (compute dtype) and the dropout's mask (1 B). Each adapter's lora_A output (r values) is kept
        for lora_B. With DoRA, each adapter also keeps two outputs (out_features each, compute dtype).
        Measured on a Qwen2 layer (CPU, peft 0.21), this errs high by under 10 % of the layer's count.
        An adapted expert stack's merged weight needs a gradient: its input is kept for each expert a
        token is routed to (experts per token x in_features; scripts/bench_memory.py measures it). An
        adapted router's merged weight likewise keeps the MLP's input (its own merged weight, experts x
        hidden, is not counted)."""
        c, adapted = compute_bytes, self.layers[layer]
        inputs = {_SHARED_INPUT[name]: fin for name, fin, _ in self.features}
        kept = {_SHARED_INPUT[name] for name in adapted} if self.dropout == 0 else set()
        if self.router:
            kept.add(_SHARED_INPUT["gate_proj"])
        dropped = sum(fin for name, fin, _ in self.features if name in adapted) * (c + 1) if self.dropout > 0 else 0
        # DoRA's output is (m / ||W + s B A|| - 1) x W + m / ||.|| x s B A x: both products are kept.
        dora = 2 * c * sum(fout for name, _, fout in self.features if name in adapted) if self.dora else 0
        stacks = c * sum(top_k * fin for _, fin, _, top_k, _ in self.stacks)
        return (dropped + len(adapted) * self.r * c + dora + stacks
                - c * sum(size for group, size in inputs.items() if group not in kept))
