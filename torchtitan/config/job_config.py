"""The trainer configuration: one dataclass per section.

Field docstrings become the ``--help`` text of ``python -m torchtitan.config.manager``
and of ``python -m torchtitan.train``. This module imports no torch, so a config can be
resolved and validated in a fraction of a second before any rank starts.

Sections marked "(not implemented yet: issue #N)" exist so configs and CLIs stay stable;
asking for their behaviour fails loudly at start-up instead of being silently ignored.
"""

import math
from dataclasses import dataclass, field
from typing import Literal

# Entries of list fields, parsed (torch-free too).
from torchtitan.config.entries import MixEntry, ParamGroup

# How the model runs across devices (parallelism, activation checkpointing, compile,
# float8), and what a run reports and how it is debugged: sections kept in their own modules.
from torchtitan.config.execution import ActivationCheckpoint, Compile, Float8, Parallelism, SemiSync
from torchtitan.config.observability import Comm, Debug, Metrics, Profiling


@dataclass
class Job:
    config_file: str | None = None
    """TOML file layered on top of the named config (``--config``); CLI flags override it."""

    dump_folder: str = "./outputs"
    """Folder for everything a run writes: checkpoints, traces, TensorBoard logs, the config."""

    description: str = ""
    """Free text describing the run; printed at start-up."""

    print_format: Literal["text", "json", "toml"] = "text"
    """How ``python -m torchtitan.config.manager`` prints the resolved config."""

    save_config_file: str | None = "config.toml"
    """File under ``dump_folder`` that receives the resolved config (TOML, loadable with
    ``--job.config_file``). ``None`` disables it."""


@dataclass
class Model:
    name: str = "llama3"
    """Model to train: a short name under ``torchtitan.models`` or any importable module path
    that provides a ``model_spec()`` function."""

    flavor: str = "debugmodel"
    """Size preset of the model, e.g. ``debugmodel``, ``1B``, ``8B``, ``70B``, ``405B``."""

    tokenizer_path: str = "tests/assets/tokenizer"
    """Tokenizer file (a tiktoken ``tokenizer.model`` as Llama 3 ships, or a Hugging Face
    ``tokenizer.json``) or a folder holding one (``tokenizer.model`` first). Relative paths are
    looked up from the working directory, then from the repository root."""

    attn_mask: Literal["causal", "block_causal"] = "causal"
    """Which tokens attention lets a token see in a training window of packed documents:
    ``causal``, every earlier token of the window (documents see their predecessors);
    ``block_causal``, only the earlier tokens of its own document (a document starts at each
    begin-of-text token), as Llama 3 was trained."""


@dataclass
class Training:
    dataset: str = "python_docs"
    """Dataset name from the registry (``python_docs``, ``python_docs_validation``, ``c4``,
    ``c4_validation``), ``files`` with ``dataset_path`` pointing at json/jsonl/parquet/txt, or
    ``tokens`` with ``dataset_path`` naming a folder ``scripts/pretokenize.py`` wrote (windows
    memory-mapped, nothing tokenized during training)."""

    dataset_path: str | None = None
    """Overrides where the dataset is read from: a local copy of a hub dataset, or the
    file / glob / folder for ``--training.dataset files``."""

    dataset_mix: list[str] = field(default_factory=list)
    """Train on several datasets in given shares of the windows (so of the tokens), in place
    of ``--training.dataset``: entries ``NAME:WEIGHT`` or ``NAME=PATH:WEIGHT`` (``PATH`` as
    ``--training.dataset_path``), weights normalised. Each dataset is read, sharded, and
    re-looped on its own; the windows interleave deterministically, each dataset as close to
    its share as whole windows allow, and resume exactly. Resuming with another mix keeps the
    place of the datasets both mixes name. Example: ``"python_docs:3" "files=code/*.jsonl:1"``
    (``docs/data.md``)."""

    shuffle_seed: int | None = None
    """Read the training documents in a random order drawn from this seed, a new order each
    epoch, each data-parallel rank a random part of the whole dataset; resumes exactly.
    ``None``: in the data's own order. Local (map-style) datasets only: a streamed one is
    refused. Fine-tuning samples shuffle alike; validation data is read in order."""

    def mix(self) -> list[MixEntry]:
        """``dataset_mix`` parsed; ``ValueError`` names the entry that does not parse."""
        entries = [MixEntry.parse(entry) for entry in self.dataset_mix]
        labels = [e.label for e in entries]
        if len(set(labels)) != len(labels):
            raise ValueError(f"names a dataset twice: {labels}")
        if not math.isfinite(sum(e.weight for e in entries)):
            raise ValueError("weights sum to infinity; use smaller ones (they are normalised)")
        for e in entries:
            if e.name in ("files", "tokens") and e.path is None:
                raise ValueError(f"{e.written}: {e.name} needs its path, {e.name}=PATH:WEIGHT")
        return entries

    data_format: Literal["text", "chat", "prompt_completion"] = "text"
    """What the dataset's rows hold. ``text``: documents (field ``text``), packed into one
    token stream, every token trained (pretraining). Supervised fine-tuning, trained on the
    answers only: ``chat``, conversations (field ``messages``, a list of ``{"role",
    "content"}``) rendered by the chat template, labels on the assistant turns;
    ``prompt_completion``, fields ``prompt`` and ``completion``, labels on the completion.
    Fine-tuning samples are packed whole into windows under ``--model.attn_mask
    block_causal`` (each sees only itself), one per window under ``causal``. Validation
    reads its dataset in the same format."""

    chat_template: str | None = None
    """Jinja chat template for ``--training.data_format chat`` (a ``.jinja`` file, or a
    ``tokenizer_config.json`` holding one); default: the tokenizer folder's
    ``chat_template.jinja`` or ``tokenizer_config.json`` chat_template."""

    train_on_prompt: bool = False
    """Fine-tuning formats: train on every token (prompts and user turns too), not only on the
    answers."""

    packing_bins: int = 1
    """Fine-tuning samples packed under ``--model.attn_mask block_causal`` go first-fit into
    this many open windows: each to the first with room, a window leaving when full, or (the
    fullest) when a sample fits none and all are open. 1 fills windows in data order; more
    waste less padding and reorder samples: a sample can wait in a window that is never the
    fullest while many others leave (``docs/sft.md``)."""

    local_batch_size: int = 8
    """Sequences per gradient-accumulation batch on each data-parallel rank (a step runs
    global_batch_size / (local_batch_size x data-parallel degree) of them, fewer while a batch
    ramp grows)."""

    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1 means local_batch_size x data-parallel
    degree. A larger multiple turns on gradient accumulation."""

    global_batch_size_start: int = -1
    """Ramp the batch up: sequences per optimizer step at step 1, growing by
    ``global_batch_size_increment`` each time another equal share of
    ``global_batch_size_ramp_sequences`` has been trained on, to ``global_batch_size``
    (Megatron-LM's ``--rampup-batch-size``; GPT-3 and DeepSeek-V3 trained so); -1: no ramp.
    The same flags give the same batch per step in every layout. The LR schedule still counts
    steps (``docs/training.md``)."""

    global_batch_size_increment: int = -1
    """Sequences added to the batch at each size of a ramp; a multiple of local_batch_size x
    data-parallel degree dividing global_batch_size - global_batch_size_start. -1: the largest
    size dividing both the start and the full batch."""

    global_batch_size_ramp_sequences: int = 0
    """Sequences trained on while a ramp grows the batch (tokens / seq_len); the full
    ``global_batch_size`` starts once they have been trained on."""

    skip_steps: list[str] = field(default_factory=list)
    """Steps whose batches are read and dropped, untrained: entries ``N`` or ``FIRST-LAST``
    (``1201-1300 1450``). The weights and optimizer state stay as they are; the step count and
    the LR schedule move on, so every later step reads and trains on what it would have. After
    a loss spike: resume from the checkpoint before it, skipping the data of the spike
    (``docs/training.md``)."""

    spike_sigma: float = 0.0
    """Skip the update of a step whose loss or gradient norm is more than this many standard
    deviations above its mean over the previous ``spike_window`` steps (6 is a common choice;
    0: off). The step's data is spent and its values join the window; no step is judged before
    the window is full. The window is checkpointed."""

    spike_window: int = 128
    """Steps whose losses and gradient norms ``spike_sigma`` compares a step with."""

    seq_len: int = 2048
    """Tokens per training sequence."""

    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 or less disables clipping."""

    steps: int = 10000
    """Number of optimizer steps to train for."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the parameters, their gradients and the optimizer's states. ``bfloat16``
    trains in bf16 throughout, with no float32 copy of the weights (half the memory of
    weights, gradients and AdamW's moments; updates smaller than a weight's bf16 spacing are
    lost); the blocks then compute in bf16 whatever ``mixed_precision_param`` says. Buffers
    (RoPE tables, routing bias) stay float32, the loss and the gradient norm are computed in
    float32 and float64 (``docs/training.md``)."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of float32 parameters (``--training.dtype float32``). Without FSDP this
    is applied with autocast; parameters stay float32."""

    mixed_precision_reduce: Literal["float32"] = "float32"
    """Dtype of gradient reductions across data-parallel ranks."""

    loss_chunks: int = 1
    """Compute the cross-entropy over this many chunks of tokens, each cast to float32 and
    recomputed in backward, so the loss's float32 copies of the full-vocabulary logits (the
    cast of bf16 logits, the log-probabilities kept for backward) exist for one chunk at a
    time; the logits and their gradient still exist whole (1: one piece)."""

    gc_freq: int = 50
    """Run Python garbage collection every N steps (automatic collection is disabled during
    training to avoid random pauses); 0 keeps Python's automatic collection."""

    gc_debug: bool = False
    """Collect garbage every step and report the reference cycles that held tensors (memory
    freed only by the collector, up to gc_freq steps late): one warning naming the tensors,
    and the cycle's reference graph in <dump_folder>/gc_debug/. Slower steps; for leaks."""

    num_workers: int = 0
    """Dataloader worker processes per rank; 0 loads in the training process."""

    data_sharding: Literal["by_document", "by_row"] = "by_document"
    """How data-parallel ranks split the data. ``by_document``: each rank reads its own share
    of the documents (what scales). ``by_row``: every rank reads the whole stream and keeps
    its rows of each global batch, so a step sees the same data whatever the data-parallel
    degree; for exact comparisons between layouts (each rank reads dp times more)."""

    enable_cpu_offload: bool = False
    """Keep FSDP-sharded parameters, gradients and optimizer state in host memory."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon"] = "AdamW"
    """``AdamW`` or ``Adam`` from ``torch.optim``; ``Muon``: orthogonalised momentum for the
    matrices inside the transformer blocks, AdamW for the rest (``docs/training.md``)."""

    lr: float = 8e-4
    """Peak learning rate."""

    beta1: float = 0.9
    """First-moment decay of Adam."""

    beta2: float = 0.95
    """Second-moment decay of Adam."""

    eps: float = 1e-8
    """Adam epsilon."""

    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW) or L2 penalty (Adam)."""

    implementation: Literal["auto", "for-loop", "foreach", "fused"] = "auto"
    """Optimizer kernel: ``auto`` picks fused where the device supports it, else foreach.
    ``stochastic_rounding`` steps with its own float32 loop instead."""

    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""

    muon_ns_steps: int = 5
    """Newton-Schulz iterations of Muon's orthogonalisation."""

    muon_ns_dtype: Literal["float32", "bfloat16"] = "float32"
    """Precision of the Newton-Schulz iteration: ``bfloat16``, as ``torch.optim.Muon`` and
    most Muon implementations iterate, runs on a GPU's bf16 tensor cores; ``float32`` is
    closer to the exact orthogonalisation."""

    stochastic_rounding: bool = False
    """With ``--training.dtype bfloat16``: compute each new weight in float32 and round it to
    bf16 at random, up with the probability of its distance from the value below, so that
    updates smaller than half a bf16 step (weight decay, a decayed LR's) add up in expectation
    instead of vanishing. The random bits depend only on ``--debug.seed`` (0 without one), the
    step, the parameter and its shard: replicas stay equal and resumes are exact
    (``docs/training.md``)."""

    param_groups: list[str] = field(default_factory=list)
    """Settings for some parameters, each ``REGEX:key=value[,key=value...]``: a trainable
    parameter whose name (``layers.0.attention_norm.weight``, as in checkpoints) the regex
    matches (``re.search``) takes these settings over the section's. Keys: ``lr_scale``
    (multiplies ``--optimizer.lr``, so the whole schedule), ``weight_decay``, ``beta1``,
    ``beta2``, ``eps``. The first entry that matches wins; one that matches no trainable
    parameter is refused. Example: ``"norm|bias:weight_decay=0" "tok_embeddings:lr_scale=0.1"``
    (``docs/training.md``)."""

    def groups(self) -> list[ParamGroup]:
        """``param_groups`` parsed, each with every setting filled in from the section's;
        ``ValueError`` names the entry that does not parse or holds a bad value."""
        defaults = dict(
            weight_decay=self.weight_decay, beta1=self.beta1, beta2=self.beta2, eps=self.eps
        )
        return [ParamGroup.parse(entry, **defaults) for entry in self.param_groups]


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warm-up from near zero to ``optimizer.lr``."""

    decay_ratio: float | None = None
    """Fraction of the steps, at the end of training, over which the LR decays; the rest after
    warm-up stays at the peak. ``None`` decays over all steps after warm-up."""

    decay_type: Literal["linear", "sqrt", "cosine", "constant"] = "linear"
    """Shape of the decay; ``constant`` keeps the peak LR after warm-up."""

    min_lr_factor: float = 0.0
    """The LR decays to ``optimizer.lr * min_lr_factor``."""

    unit: Literal["steps", "tokens"] = "steps"
    """What the schedule counts. ``steps``: optimizer steps. ``tokens``: tokens trained on, in
    full global batches' worth (``warmup_steps`` 200 warms up over the tokens of 200 full
    batches), so under a batch-size ramp (``--training.global_batch_size_start``) the small
    early steps move the LR less, as Megatron-LM's sample-counted schedules do; the same
    curve as ``steps`` at a fixed batch."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save and resume with torch.distributed.checkpoint."""

    folder: str = "checkpoint"
    """Folder under ``job.dump_folder`` holding one ``step-N`` folder per checkpoint."""

    interval: int = 500
    """Save every N steps."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Save in the background while training continues."""

    keep_latest_k: int = 10
    """Keep only the newest K checkpoints; 0 keeps all."""

    keep_every: int = 0
    """Also keep, for good, the checkpoints of every N-th step (milestones to evaluate or fork
    later) however many newer ones there are; a multiple of ``interval``. 0: none."""

    load_step: int = -1
    """Step to resume from; -1 picks the latest complete checkpoint."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """State to skip when loading, e.g. ``dataloader lr_scheduler``."""

    enable_first_step_checkpoint: bool = False
    """Also save right after step 1."""

    initial_load_path: str | None = None
    """Start from another run's checkpoint folder (weights only), or from a Hugging Face model
    folder (``config.json`` + safetensors), read in any parallel layout. Read only while this
    run's own folder has no checkpoint."""

    initial_load_model_only: bool = True
    """Read only the weights of ``--checkpoint.initial_load_path`` (the run starts at step 0).
    Off (``--checkpoint.no_initial_load_model_only``), with a full ``step-N`` of another run:
    read everything it holds less ``--checkpoint.exclude_from_loading`` (optimizer, LR
    schedule, data position, step), so this run forks that one at step N and goes on in its
    own folder."""

    load_only: bool = False
    """Load checkpoints but never save."""

    last_save_model_only: bool = False
    """The final save keeps only the model weights (an export: the run cannot be extended from
    it). Off by default: the final save is a full checkpoint, so a finished run continues with
    a larger ``--training.steps``."""

    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of weights in a model-only save and in the Hugging Face export."""

    last_save_in_hf: bool = False
    """After the final save, also write the weights as a Hugging Face folder
    (``<folder>/hf-step-N``: safetensors shards, their index and a ``config.json`` that
    ``transformers`` loads). ``--checkpoint.initial_load_path`` takes such a folder."""

    create_seed_checkpoint: bool = False
    """Write initial weights as step 0 on one process and exit."""


@dataclass
class LoRA:
    """Low-rank adapters: fine-tune a pretrained model (``--checkpoint.initial_load_path``) by
    training two small matrices beside chosen linear layers while every original weight stays
    frozen (``docs/lora.md``)."""

    rank: int = 0
    """Rank r of each adapter (``A: [r, in]``, ``B: [out, r]``); 0 turns LoRA off."""

    alpha: float = 16.0
    """The adapter's output is scaled by ``alpha / rank``."""

    target_modules: list[str] = field(default_factory=list)
    """Linear layers that get adapters, by name or dotted name suffix (``wq``,
    ``attention.wo``, ``shared_experts.w1``, ``output``); empty: every linear layer inside the
    transformer blocks except MoE routers. Routed experts and embeddings get none. Separate
    names by spaces or commas."""

    save_adapters_only: bool = False
    """Checkpoints hold the adapters, their optimizer state and the rest of the training state,
    not the frozen weights: a resume, ``torchtitan.generate`` and ``scripts/convert_hf.py``
    read those again from ``--checkpoint.initial_load_path`` (required; it must not change).
    Llama 3 8B at rank 16: 0.5 GB per save instead of 32 GB."""

    def targets(self) -> list[str]:
        """``target_modules`` with comma-separated entries split."""
        return [name for entry in self.target_modules for name in entry.split(",") if name]


@dataclass
class MoE:
    """Training-time settings of mixture-of-experts layers (the experts' shapes are the
    flavor's); ignored by dense models."""

    load_balance_coeff: float = 1e-3
    """Auxiliary-loss-free balancing: after each optimizer step every expert's routing bias
    moves by this much towards balance (up when the expert got fewer tokens than the mean over
    the global batch, down when more). 0 stops the updates (a learned or loaded bias still
    steers the routing)."""

    aux_loss_coeff: float = 0.0
    """Weight of the sequence-wise balance loss (DeepSeek-V3's complementary loss: per sequence,
    the fraction of routings each expert got times its mean normalised score); 0 turns it off."""

    capacity_factor: float = 0.0
    """Drop routings beyond ``capacity_factor x tokens x top_k / num_experts`` per expert in
    each forward of a rank (a micro-batch; before expert parallelism's exchange), the lowest
    route weights first; 0 never drops a token."""

    experts_impl: Literal["auto", "grouped_mm", "loop"] = "auto"
    """How experts compute: ``grouped_mm`` (one ``torch._grouped_mm`` over every expert's
    rows), ``loop`` (one matmul per expert, the reference), ``auto`` (grouped where the dtype
    and dims allow it)."""

    force_load_balance: bool = False
    """For benchmarks and debugging, not training: every expert gets the same number of
    routings (a token's j-th routing in a rank's forward goes to expert ``(t x top_k + j) mod
    num_experts``, ``t`` its index there), so throughput and memory are measured without
    routing imbalance (expert-parallel all-to-alls even). The route weights still come from
    the router's scores for those experts, so the router trains; the routing bias stays put
    (torchtitan's ``--debug.moe_force_load_balance``)."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on a held-out dataset during training (forward only, in the training
    layout; the training data position, RNG and gradients are untouched)."""

    dataset: str = "python_docs_validation"
    """Validation dataset: a registry name, or ``files`` with ``--validation.dataset_path``."""

    dataset_path: str | None = None
    """Overrides where the validation dataset is read from."""

    local_batch_size: int = -1
    """Sequences per validation batch on each data-parallel rank (-1: the training's; under
    pipeline parallelism it must be the training's)."""

    seq_len: int = -1
    """Tokens per validation sequence (-1: the training's; at most the training's, which sizes
    the RoPE table; under pipeline parallelism it must be the training's)."""

    freq: int = 500
    """Validate every N steps (and after the last step)."""

    steps: int = -1
    """Batches per validation; -1 runs the whole dataset once (its last partial batch left
    out)."""

    only: bool = False
    """Validate the loaded weights once and stop, training nothing (Megatron-LM's
    ``--skip-train``): the newest checkpoint of ``--job.dump_folder`` (or
    ``--checkpoint.load_step``), else ``--checkpoint.initial_load_path`` (a step, an averaged
    checkpoint, an HF folder). Nothing is saved and the run's records are left as they are; the
    result is also appended to ``<dump_folder>/validation_only.jsonl``."""

    sample_prompt: str = ""
    """After the last step, print the model's continuation of this prompt (temperature 0.7,
    top-k 50, seeded; one process or data parallel, skipped with a notice under TP, CP or PP).
    ``python -m torchtitan.generate`` samples from any checkpoint."""

    sample_tokens: int = 40
    """Tokens to generate for ``sample_prompt``."""


@dataclass
class JobConfig:
    """Everything a training run needs, one section per concern."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    semi_sync: SemiSync = field(default_factory=SemiSync)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    lora: LoRA = field(default_factory=LoRA)
    moe: MoE = field(default_factory=MoE)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)
    validation: Validation = field(default_factory=Validation)
