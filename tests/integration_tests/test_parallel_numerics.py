"""Every parallel layout trains exactly like one process: same weights, same global batches,
deterministic mode, float32; per-step losses and final weights compared with the reference.

All cases of one world size share a single torchrun launch (``numerics_harness.py``).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan.components import float8
from torchtitan.distributed.pipeline_split import SCHEDULES as PP_SCHEDULES

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests/integration_tests/numerics_harness.py"
# 6 steps: past the warm-up, far enough for any layout's error to reach the losses and the
# weights (steps 7-10 took a third of the launches' time, 3.8 min of the suite, and no
# mutation tried here needed them to show).
STEPS = 6
BASE = (
    f"--training.seq_len 32 --training.steps {STEPS} --lr_scheduler.warmup_steps 2 "
    "--debug.seed 0 --debug.deterministic --metrics.log_freq 1"
)
LOSS_RTOL = 1e-5
# Summation order differs between layouts (~1e-7 relative in gradients); Adam's
# m / sqrt(v) amplifies it where gradients are near zero. 6 steps x lr 8e-4 can move a
# weight by 5e-3: 5e-5 is 1% of that.
WEIGHT_ATOL = 5e-5

REFERENCE = ("ref", 1, "--training.local_batch_size 8")
# Per-document attention, on windows long enough to hold document starts.
BLOCK_CAUSAL = "--model.attn_mask block_causal --training.seq_len 128"
BLOCK_CAUSAL_REFERENCE = ("ref_block_causal", 1, f"--training.local_batch_size 8 {BLOCK_CAUSAL}")
# Mixture of experts (cases named moe_*): DeepSeek-V3's debug flavor with the sequence-wise
# balance loss on and a bias step large enough to change routing within the steps; optimizer
# groups (routers at half the LR, norms without weight decay) across every layout's sharding.
MOE = (
    "--module deepseek_v3 --config deepseek_v3_debugmodel --moe.aux_loss_coeff 0.01 "
    "--moe.load_balance_coeff 0.01 --optimizer.param_groups router:lr_scale=0.5 "
    "norm:weight_decay=0"
)
MOE_REFERENCE = ("ref_moe", 1, f"--training.local_batch_size 8 {MOE}")
# Qwen3 cases train with Muon (the blocks' matrices orthogonalised whole, each by one rank of
# those splitting it; the rest AdamW): TP's and FSDP's shards must give the one-process update.
# Two Newton-Schulz steps instead of five: the same spreading and return of the stacks, 2.5x
# less of the iteration (with five, qwen3moe_ep2_tp2 took 31 s of the 4-rank launch's 276).
MUON = "--optimizer.name Muon --optimizer.lr 0.003 --optimizer.muon_ns_steps 2"
QWEN3 = f"--module qwen3 --config qwen3_debugmodel {MUON}"
QWEN3_REFERENCE = ("ref_qwen3", 1, f"--training.local_batch_size 8 {QWEN3}")
# Qwen3's MoE (cases named qwen3moe_*): Llama 3's attention plans with the shared MoE plans,
# softmax routing without shared experts; both balancing rules on, as for MOE; Muon (the
# experts' stacked matrices orthogonalised per expert, across EP, TP and PP layouts).
QWEN3_MOE = (
    "--module qwen3 --config qwen3_moe_debugmodel --moe.aux_loss_coeff 0.01 "
    f"--moe.load_balance_coeff 0.01 {MUON}"
)
QWEN3_MOE_REFERENCE = ("ref_qwen3moe", 1, f"--training.local_batch_size 8 {QWEN3_MOE}")
# gpt-oss (cases named gptoss_*): attention sinks, a 32-token window in every other block,
# biased projections and experts, the clamped SwiGLU; per-document attention on windows that
# hold document starts; both balancing rules on, as for MOE.
GPT_OSS = (
    "--module gpt_oss --config gpt_oss_debugmodel --model.attn_mask block_causal "
    "--training.seq_len 128 --moe.aux_loss_coeff 0.01 --moe.load_balance_coeff 0.01"
)
GPT_OSS_REFERENCE = ("ref_gptoss", 1, f"--training.local_batch_size 8 {GPT_OSS}")
# Llama 4 (cases named llama4_*): experts (top 1, scaled on the way in, a shared one) in every
# 2nd block, dense blocks between; chunks of 32 tokens in the blocks with RoPE, a block
# without RoPE scaling its queries by position; per-document attention; both balancing rules.
LLAMA4 = (
    "--module llama4 --config llama4_debugmodel --model.attn_mask block_causal "
    "--training.seq_len 128 --moe.aux_loss_coeff 0.01 --moe.load_balance_coeff 0.01"
)
LLAMA4_REFERENCE = ("ref_llama4", 1, f"--training.local_batch_size 8 {LLAMA4}")
# LoRA (cases named lora_*): rank-4 adapters on every block's linear layers, the rest frozen;
# a scale (alpha / rank = 8) at which they move the loss within the steps at the config's
# learning rate (at 5x that rate torch 2.11 put one adapter 9e-5 from one process's: B starts
# at zero, so A's first gradients are near zero, where Adam amplifies summation order).
LORA = "--lora.rank 4 --lora.alpha 32"
LORA_REFERENCE = ("ref_lora", 1, f"--training.local_batch_size 8 {LORA}")
# Fine-tuning (cases named sft_*): the bundled conversations, answers only, packed whole into
# windows, each sample its own document (numbered by the data, not by begin-of-text tokens).
SFT = (
    "--training.dataset chat_demo --training.data_format chat --model.attn_mask block_causal "
    "--training.seq_len 128"
)
SFT_REFERENCE = ("ref_sft", 1, f"--training.local_batch_size 8 {SFT}")
# Validation (cases named validation_*) after steps 3 and 6, in global batches of 8 rows read
# alike by every layout (by_row): the first 4 of the bundled split's full batches;
# ref_validation_all reads them all once.
VALIDATION = (
    "--validation.enable --validation.freq 3 --validation.steps 4 --training.data_sharding by_row"
)
VALIDATION_REFERENCE = ("ref_validation", 1, f"--training.local_batch_size 8 {VALIDATION}")
WHOLE_SPLIT = (
    "ref_validation_all",
    1,
    f"--training.local_batch_size 8 --validation.enable --validation.freq {STEPS} "
    "--validation.steps -1",
)
# A batch ramp: 8, 8, 16, 24, 24, 24 sequences per step (Megatron's rule: 8 until 16 are
# trained on, 16 until 32), in 1 to 3 accumulation batches of 8 sequences over the
# data-parallel ranks (under pipelines, each cut into micro-batches); the MoE case's balance
# loss and bias update see steps of unequal sizes.
RAMP = (
    "--training.global_batch_size 24 --training.global_batch_size_start 8 "
    "--training.global_batch_size_ramp_sequences 32"
)
RAMP_REFERENCE = ("ref_ramp", 1, f"--training.local_batch_size 8 {RAMP}")
RAMP_MOE_REFERENCE = ("ref_ramp_moe", 1, f"--training.local_batch_size 8 {RAMP} {MOE}")
CASES = {
    # name: (ranks, flags); local_batch_size x data-parallel degree = 8 sequences per step
    "ramp_fsdp2": (2, f"--training.local_batch_size 4 {RAMP}"),
    "ramp_pp2_fsdp2": (
        4,
        f"--training.local_batch_size 4 {RAMP} --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2",
    ),
    "ramp_moe_ep2": (
        2,
        f"{MOE} --training.local_batch_size 4 {RAMP} --parallelism.expert_parallel_degree 2",
    ),
    "fsdp2": (2, "--training.local_batch_size 4"),
    "ddp2": (
        2,
        "--training.local_batch_size 4 --parallelism.data_parallel_replicate_degree 2 "
        "--parallelism.data_parallel_shard_degree 1",
    ),
    "tp2": (2, "--training.local_batch_size 8 --parallelism.tensor_parallel_degree 2"),
    # The vocab-sharded cross-entropy in chunks of tokens (each recomputed in backward).
    "tp2_no_sequence_parallel": (
        2,
        "--training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 "
        "--parallelism.no_enable_sequence_parallel --training.loss_chunks 4",
    ),
    "tp2_no_loss_parallel": (
        2,
        "--training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 "
        "--parallelism.disable_loss_parallel",
    ),
    # Prefetching (all-gathers of the next blocks started early) changes timing only.
    "fsdp2_ac_full": (
        2,
        "--training.local_batch_size 4 --activation_checkpoint.mode full "
        "--parallelism.fsdp_prefetch 2",
    ),
    "fsdp2_ac_every_2nd_block": (
        2,
        "--training.local_batch_size 4 --activation_checkpoint.mode selective "
        "--activation_checkpoint.selective_ac_option 2 --training.loss_chunks 3",
    ),
    "fsdp2_ac_ops": (
        2,
        "--training.local_batch_size 4 --activation_checkpoint.mode selective "
        "--activation_checkpoint.selective_ac_option op",
    ),
    # Compiled TP blocks (the first one's input copied: torch 2.13), checkpointed per op; the
    # loss-parallel cross-entropy stays eager (compiled, it gave a wrong value).
    "tp2_compile_ac_ops": (
        2,
        "--training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 "
        "--compile.enable --activation_checkpoint.mode selective "
        "--activation_checkpoint.selective_ac_option op",
    ),
    # The compiler's partitioner choosing what to recompute within a budget, in graphs holding
    # TP's collectives (their process group sized as nothing: torch 2.13 refuses otherwise);
    # inductor's partitioner without its C++ compile (13 s more on a cold cache; inductor by
    # hand gives the same losses).
    "tp2_compile_memory_budget": (
        2,
        "--training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 "
        "--compile.enable --compile.backend aot_eager_decomp_partition "
        "--activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget 0.2",
    ),
    "fsdp2_tp2": (4, "--training.local_batch_size 4 --parallelism.tensor_parallel_degree 2"),
    # DTensor-parametrized sharding (what COMM_MODE=local_tensor uses), in a real run.
    "simple_fsdp2_tp2": (
        4,
        "--training.local_batch_size 4 --parallelism.tensor_parallel_degree 2 "
        "--parallelism.fsdp_impl simple",
    ),
    "hsdp2x2": (
        4,
        "--training.local_batch_size 2 --parallelism.data_parallel_replicate_degree 2 "
        "--parallelism.fsdp_prefetch 1",
    ),
    # Pipeline: 4 micro-batches of 2; multi-stage schedules hold 2 stages per rank (4 stages).
    **{
        f"pp2_{schedule.lower()}": (
            2,
            "--training.local_batch_size 8 --parallelism.pipeline_parallel_degree 2 "
            f"--parallelism.pipeline_parallel_microbatch_size 2 "
            f"--parallelism.pipeline_parallel_schedule {schedule}",
        )
        for schedule in PP_SCHEDULES
    },
    # Hand-written CSV schedules (tests/assets/pipeline/), plain and split backward.
    **{
        f"pp2_csv_{name}": (
            2,
            "--training.local_batch_size 8 --parallelism.pipeline_parallel_degree 2 "
            "--parallelism.pipeline_parallel_microbatch_size 2 "
            f"--parallelism.pipeline_parallel_schedule_csv tests/assets/pipeline/{csv}.csv",
        )
        for name, csv in (
            ("looped", "looped_2ranks_4stages"),
            ("split_backward", "looped_2ranks_4stages_split_backward"),
        )
    },
    "pp2_1f1b_compile_ac": (
        2,
        "--training.local_batch_size 8 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2 --compile.enable "
        "--activation_checkpoint.mode full",
    ),
    # Two accumulation batches of 4, each cut into 2 pipeline micro-batches of 2.
    "pp2_accumulation": (
        2,
        "--training.local_batch_size 4 --training.global_batch_size 8 "
        "--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_microbatch_size 2",
    ),
    "pp2_ddp2": (
        4,
        "--training.local_batch_size 4 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2 "
        "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1",
    ),
    "pp2_tp2": (
        4,
        "--training.local_batch_size 8 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2 --parallelism.tensor_parallel_degree 2",
    ),
    # The 3D layout of large-scale pretraining: 8 ranks on 2 cores, the slowest launch.
    "pp2_fsdp2_tp2": (
        8,
        "--training.local_batch_size 4 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2 --parallelism.tensor_parallel_degree 2",
    ),
    "pp2_hsdp2x2": (
        8,
        "--training.local_batch_size 2 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 1 "
        "--parallelism.data_parallel_replicate_degree 2",
    ),
    "pp2_fsdp2": (
        4,
        "--training.local_batch_size 4 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2",
    ),
    # Zero-bubble under FSDP: exact only because default resharding becomes never.
    "pp2_fsdp2_zbv": (
        4,
        "--training.local_batch_size 4 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 1 "
        "--parallelism.pipeline_parallel_schedule ZBVZeroBubble",
    ),
    "compile": (1, "--training.local_batch_size 8 --compile.enable"),
    # Context parallel: every sequence split over the cp ranks, ring attention between them.
    "cp2": (2, "--training.local_batch_size 8 --parallelism.context_parallel_degree 2"),
    "cp2_alltoall_unbalanced": (
        2,
        "--training.local_batch_size 8 --parallelism.context_parallel_degree 2 "
        "--parallelism.context_parallel_rotate_method alltoall "
        "--parallelism.no_context_parallel_load_balance",
    ),
    "cp2_compile_ac": (
        2,
        "--training.local_batch_size 8 --parallelism.context_parallel_degree 2 "
        "--compile.enable --activation_checkpoint.mode full",
    ),
    "cp4": (4, "--training.local_batch_size 8 --parallelism.context_parallel_degree 4"),
    "fsdp2_cp2": (4, "--training.local_batch_size 4 --parallelism.context_parallel_degree 2"),
    "tp2_cp2": (
        4,
        "--training.local_batch_size 8 --parallelism.context_parallel_degree 2 "
        "--parallelism.tensor_parallel_degree 2",
    ),
    "hsdp2_cp2": (
        4,
        "--training.local_batch_size 4 --parallelism.context_parallel_degree 2 "
        "--parallelism.data_parallel_replicate_degree 2",
    ),
    # Block-causal attention: the document numbers reach every block, shard and stage.
    "fsdp2_block_causal": (2, f"--training.local_batch_size 4 {BLOCK_CAUSAL}"),
    "tp2_block_causal": (
        2,
        f"--training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 {BLOCK_CAUSAL}",
    ),
    "pp2_block_causal": (
        2,
        "--training.local_batch_size 8 --parallelism.pipeline_parallel_degree 2 "
        f"--parallelism.pipeline_parallel_microbatch_size 2 {BLOCK_CAUSAL}",
    ),
    # Under CP each rank's queries attend to the whole sequence's K/V (gathered), masked by
    # the whole window's documents: compiled with full AC (the gather inside the checkpoint),
    # and eager (one SDPA call per document run) across TP heads.
    "cp2_compile_ac_block_causal": (
        2,
        "--training.local_batch_size 8 --parallelism.context_parallel_degree 2 "
        f"--compile.enable --activation_checkpoint.mode full {BLOCK_CAUSAL}",
    ),
    "tp2_cp2_block_causal": (
        4,
        "--training.local_batch_size 8 --parallelism.context_parallel_degree 2 "
        f"--parallelism.tensor_parallel_degree 2 {BLOCK_CAUSAL}",
    ),
    "pp2_cp2": (
        4,
        "--training.local_batch_size 8 --parallelism.context_parallel_degree 2 "
        "--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_microbatch_size 2",
    ),
    # Mixture of experts: experts sharded by FSDP, split over ranks by EP (all-to-all), with
    # TP on attention and the shared experts.
    "moe_ep2": (2, f"{MOE} --training.local_batch_size 4 --parallelism.expert_parallel_degree 2"),
    "moe_ep2_loop": (
        2,
        f"{MOE} --training.local_batch_size 4 --parallelism.expert_parallel_degree 2 "
        "--moe.experts_impl loop",
    ),
    # Qwen3's per-head query/key norms: each TP rank normalizes its own heads with the one
    # replicated weight, whose gradient sums over the ranks; without sequence parallelism they
    # are the only such weights (2D under FSDP x TP: qwen3moe_ep2_tp2, whose attention and
    # norms are the dense model's, and Muon on its FSDP x TP matrices).
    "qwen3_tp2_no_sp": (
        2,
        f"{QWEN3} --training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 "
        "--parallelism.no_enable_sequence_parallel",
    ),
    # Muon's most common layout: FSDP's row shards, each stack of same-shaped updates spread so
    # that each rank orthogonalises half of the matrices, whole.
    "qwen3_fsdp2": (2, f"{QWEN3} --training.local_batch_size 4"),
    # Qwen3's MoE: TP splitting every expert's hidden width; EP across the TP ranks (each
    # routing its own sequence shard) with the experts FSDP-sharded over the rest; pipeline
    # stages with experts split by EP.
    "qwen3moe_tp2_no_sp": (
        2,
        f"{QWEN3_MOE} --training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 "
        "--parallelism.no_enable_sequence_parallel",
    ),
    "qwen3moe_ep2_tp2": (
        4,
        f"{QWEN3_MOE} --training.local_batch_size 4 --parallelism.expert_parallel_degree 2 "
        "--parallelism.tensor_parallel_degree 2",
    ),
    "qwen3moe_pp2_ep2": (
        4,
        f"{QWEN3_MOE} --training.local_batch_size 4 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2 --parallelism.expert_parallel_degree 2",
    ),
    # gpt-oss: each TP rank its heads' sinks and biases, its share of every expert's hidden
    # width and biases (the output's bias counted once over the partial sums); CP gathering
    # the sequence's keys for windows and sinks, EP over the CP ranks.
    "gptoss_tp2_no_sp": (
        2,
        f"{GPT_OSS} --training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 "
        "--parallelism.no_enable_sequence_parallel",
    ),
    "gptoss_cp2_ep2": (
        2,
        f"{GPT_OSS} --training.local_batch_size 8 --parallelism.context_parallel_degree 2 "
        "--parallelism.expert_parallel_degree 2",
    ),
    # Llama 4: TP with sequence parallelism over the dense blocks, the shared and the routed
    # experts' widths (the router's scores scaling the rows on their way in; the attention's
    # query temperature over the gathered sequence); CP gathering the keys for chunks, EP over
    # the CP ranks; pipeline stages of dense and expert blocks under FSDP.
    "llama4_tp2": (
        2,
        f"{LLAMA4} --training.local_batch_size 8 --parallelism.tensor_parallel_degree 2",
    ),
    "llama4_cp2_ep2": (
        2,
        f"{LLAMA4} --training.local_batch_size 8 --parallelism.context_parallel_degree 2 "
        "--parallelism.expert_parallel_degree 2",
    ),
    "llama4_pp2_fsdp2": (
        4,
        f"{LLAMA4} --training.local_batch_size 4 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2",
    ),
    # TP without EP splits every expert's hidden width (routed and shared).
    "moe_tp2_no_sp": (
        2,
        f"{MOE} --training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 "
        "--parallelism.no_enable_sequence_parallel",
    ),
    # Compiled around the routed experts (eager), checkpointed per op; the shared experts'
    # replicated input takes its gradient share by hand (compiled, redistributing to Partial
    # is refused).
    "moe_fsdp2_tp2_compile_ac_ops": (
        4,
        f"{MOE} --training.local_batch_size 4 --parallelism.tensor_parallel_degree 2 "
        "--compile.enable --activation_checkpoint.mode selective "
        "--activation_checkpoint.selective_ac_option op",
    ),
    # The first stage holds only the dense block: it still joins the stages' metric gather.
    "moe_pp2": (
        2,
        f"{MOE} --training.local_batch_size 8 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2 "
        "--parallelism.module_fqns_per_model_part tok_embeddings,layers.0 "
        "layers.1,layers.2,layers.3,norm,output",
    ),
    # Prefetch lists hold each block's expert unit too.
    "moe_ep2_fsdp2": (
        4,
        f"{MOE} --training.local_batch_size 2 --parallelism.expert_parallel_degree 2 "
        "--parallelism.fsdp_prefetch 1",
    ),
    "moe_hsdp2x2_ep2": (
        4,
        f"{MOE} --training.local_batch_size 2 --parallelism.expert_parallel_degree 2 "
        "--parallelism.data_parallel_replicate_degree 2",
    ),
    "moe_ep2_tp2": (
        4,
        f"{MOE} --training.local_batch_size 4 --parallelism.expert_parallel_degree 2 "
        "--parallelism.tensor_parallel_degree 2",
    ),
    # Validation in the training layout (forward only; PP runs the schedule's eval).
    "validation_fsdp2": (2, f"--training.local_batch_size 4 {VALIDATION}"),
    "validation_tp2": (
        2,
        f"--training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 {VALIDATION}",
    ),
    "validation_pp2": (
        2,
        "--training.local_batch_size 8 --parallelism.pipeline_parallel_degree 2 "
        f"--parallelism.pipeline_parallel_microbatch_size 2 {VALIDATION}",
    ),
    "validation_cp2": (
        2,
        f"--training.local_batch_size 8 --parallelism.context_parallel_degree 2 {VALIDATION}",
    ),
    # Context parallelism: the balance loss's routing shares summed over the sequence shards;
    # experts split over the CP ranks, then over CP x dp_shard, then over TP x CP.
    "moe_cp2": (2, f"{MOE} --training.local_batch_size 8 --parallelism.context_parallel_degree 2"),
    "moe_cp2_ep2": (
        2,
        f"{MOE} --training.local_batch_size 8 --parallelism.context_parallel_degree 2 "
        "--parallelism.expert_parallel_degree 2",
    ),
    "moe_fsdp2_cp2_ep4": (
        4,
        f"{MOE} --training.local_batch_size 4 --parallelism.context_parallel_degree 2 "
        "--parallelism.expert_parallel_degree 4",
    ),
    # MoE blocks compile around the routed experts (eager, with EP's exchange hooks), under
    # full activation checkpointing.
    "moe_ep2_compile_ac": (
        2,
        f"{MOE} --training.local_batch_size 4 --parallelism.expert_parallel_degree 2 "
        "--compile.enable --activation_checkpoint.mode full",
    ),
    # LoRA: adapters placed from their layers' TP placements (column-parallel: B split with
    # the outputs; row-parallel: A split with the inputs), FSDP-sharded with the frozen
    # weights; pipeline stages adapt their own blocks.
    "lora_fsdp2_tp2": (
        4,
        f"{LORA} --training.local_batch_size 4 --parallelism.tensor_parallel_degree 2",
    ),
    "lora_pp2_fsdp2": (
        4,
        f"{LORA} --training.local_batch_size 4 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2",
    ),
    "sft_fsdp2_tp2": (
        4,
        f"{SFT} --training.local_batch_size 4 --parallelism.tensor_parallel_degree 2",
    ),
    "sft_cp2": (2, f"{SFT} --training.local_batch_size 8 --parallelism.context_parallel_degree 2"),
    "moe_tp2_cp2_ep4": (
        4,
        f"{MOE} --training.local_batch_size 8 --parallelism.context_parallel_degree 2 "
        "--parallelism.tensor_parallel_degree 2 --parallelism.expert_parallel_degree 4",
    ),
}

# float8 (torchao) under FSDP 2: not equal to float32, close to it (compared with fsdp2).
# torch 2.11's CPU float8 matmul refuses row-wise scales: emulated there.
ROW_SCALES = "" if float8.cpu_takes_row_scales() else " --float8.emulate"
FLOAT8_CASES = {
    f"float8_fsdp2_{recipe}": (
        2,
        f"--training.local_batch_size 4 --float8.enable --float8.recipe_name {recipe}"
        + (ROW_SCALES if recipe == "rowwise" else ""),
    )
    for recipe in ("tensorwise", "rowwise")
}
# FSDP gathers the float8 weights (as bytes over gloo) with their scales precomputed after each
# optimizer step; TP (without sequence parallelism: gloo cannot move float8 activations) with
# torchao's float8 styles.
FLOAT8_CASES["float8_fsdp2_tensorwise_gathered"] = (
    2,
    "--training.local_batch_size 4 --float8.enable --float8.enable_fsdp_float8_all_gather",
)
FLOAT8_CASES["float8_tp2"] = (
    2,
    "--training.local_batch_size 8 --float8.enable --parallelism.tensor_parallel_degree 2 "
    "--parallelism.no_enable_sequence_parallel",
)

# bf16 parameters, gradients and optimizer states (--training.dtype bfloat16) against the same
# in one process: the same bf16 numerics up to summation order, which moves a weight by a
# bf16 step now and then. The cases cover FSDP's policy over bf16 parameters, the bf16
# activations pipeline stages send each other, and bf16 experts exchanged by EP's all-to-all.
BF16 = "--training.dtype bfloat16"
BF16_REFERENCE = ("ref_bf16", 1, f"--training.local_batch_size 8 {BF16}")
BF16_MOE_REFERENCE = ("ref_bf16_moe", 1, f"--training.local_batch_size 8 {BF16} {MOE}")
# Stochastic rounding draws its bits per shard: a layout rounds other weights up than one
# process does, each within a bf16 step of the same float32 update.
SR = f"{BF16} --optimizer.stochastic_rounding"
BF16_SR_REFERENCE = ("ref_bf16_sr", 1, f"--training.local_batch_size 8 {SR}")
BF16_SR_CASES = {
    "bf16_sr_fsdp2_tp2": (
        4,
        f"--training.local_batch_size 4 {SR} --parallelism.tensor_parallel_degree 2",
    ),
}
BF16_CASES = {
    "bf16_moe_ep2": (
        2,
        f"--training.local_batch_size 4 {BF16} {MOE} --parallelism.expert_parallel_degree 2",
    ),
    "bf16_fsdp2": (2, f"--training.local_batch_size 4 {BF16}"),
    "bf16_pp2": (
        2,
        f"--training.local_batch_size 8 {BF16} --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2",
    ),
}

pytestmark = pytest.mark.integration


def _launch(out: Path, ranks: int, cases: list[tuple[str, str]], *, retried: bool = False) -> None:
    args = [f"{name}:{BASE} {flags}" for name, flags in cases]
    if ranks == 1:
        cmd = [sys.executable, str(HARNESS), str(out), *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
            str(HARNESS), str(out), *args,
        ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # A crash prints the Python stack of every thread (faulthandler).
    env |= {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    crashed = result.returncode < 0 or _killed_by_signal(result.stderr)
    if result.returncode != 0 and not retried and crashed:
        # torch 2.13's CPU build crashes a rank now and then inside C++ (SIGSEGV seen once in a
        # 17-case 4-rank launch, not reproduced in the next full launch; SIGABRT at exit is
        # known): run the cases without a result again, once, and say so.
        left = [(n, f) for n, f in cases if not (out / f"{n}.pt").is_file()]
        for name, _ in left:  # the crashed attempt's metrics.jsonl would be appended to
            shutil.rmtree(out / name, ignore_errors=True)
        print(f"numerics launch of {ranks} ranks crashed; rerunning {[n for n, _ in left]}")
        print(result.stderr[-4000:])
        return _launch(out, ranks, left, retried=True)
    assert result.returncode == 0, result.stderr[-4000:]


def _killed_by_signal(stderr: str) -> bool:
    return "(SIGSEGV)" in stderr or "(SIGABRT)" in stderr or "(SIGBUS)" in stderr


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("numerics")
    references = (REFERENCE, BLOCK_CAUSAL_REFERENCE, MOE_REFERENCE, QWEN3_REFERENCE)
    references += (QWEN3_MOE_REFERENCE, GPT_OSS_REFERENCE, LLAMA4_REFERENCE)
    references += (VALIDATION_REFERENCE, LORA_REFERENCE, SFT_REFERENCE)
    references += (WHOLE_SPLIT, BF16_REFERENCE, BF16_MOE_REFERENCE, BF16_SR_REFERENCE)
    references += (RAMP_REFERENCE, RAMP_MOE_REFERENCE)
    # Compiled cases first in each launch: on a cold compile cache, torch 2.13's partitioner
    # failed moe_fsdp2_tp2_compile_ac_ops ("Node tangents_2 was invalid, but is output") after
    # eight eager cases had run in the same processes; first, or alone, it compiles and passes.
    cases = CASES | FLOAT8_CASES | BF16_CASES | BF16_SR_CASES
    cases = sorted(cases.items(), key=lambda case: "compile" not in case[0])
    one_process = [(n, f) for n, (r, f) in cases if r == 1]  # with the references
    _launch(out, 1, one_process + [(name, flags) for name, _, flags in references])
    for world in sorted({ranks for _, (ranks, _) in cases} - {1}):
        _launch(out, world, [(n, f) for n, (r, f) in cases if r == world])
    return out


def _load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_matches_one_process(results, case):
    reference = REFERENCE[0]
    if case.startswith("ramp_moe_"):
        reference = RAMP_MOE_REFERENCE[0]
    elif case.startswith("ramp_"):
        reference = RAMP_REFERENCE[0]
    elif case.endswith("_block_causal"):
        reference = BLOCK_CAUSAL_REFERENCE[0]
    elif case.startswith("moe_"):
        reference = MOE_REFERENCE[0]
    elif case.startswith("qwen3_"):
        reference = QWEN3_REFERENCE[0]
    elif case.startswith("qwen3moe_"):
        reference = QWEN3_MOE_REFERENCE[0]
    elif case.startswith("gptoss_"):
        reference = GPT_OSS_REFERENCE[0]
    elif case.startswith("llama4_"):
        reference = LLAMA4_REFERENCE[0]
    elif case.startswith("validation_"):
        reference = VALIDATION_REFERENCE[0]
    elif case.startswith("lora_"):
        reference = LORA_REFERENCE[0]
    elif case.startswith("sft_"):
        reference = SFT_REFERENCE[0]
    ref, run = _load(results, reference), _load(results, case)
    assert [r["step"] for r in run["records"]] == list(range(1, STEPS + 1))
    for got, want in zip(run["records"], ref["records"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), got["step"]
    assert run["weights"].keys() == ref["weights"].keys()
    for name, want in ref["weights"].items():
        torch.testing.assert_close(run["weights"][name], want, rtol=0, atol=WEIGHT_ATOL, msg=name)


def _trains(losses: list[float]) -> bool:
    """The loss fell by 0.3 within the steps. The best of the last three steps: torch 2.11
    draws other initial weights from the same seed, and its run (8.07 -> 7.69 at step 5) went
    back up to 7.96 at step 6, where torch 2.13's goes 8.12 -> 7.67."""
    return min(losses[-3:]) < losses[0] - 0.3


def test_reference_actually_trains(results):
    losses = [r["loss"] for r in _load(results, "ref")["records"]]
    assert _trains(losses)


def test_ramp_grows_the_batch(results):
    """The ramp's first two steps are the fixed run's (8 sequences each, the same windows);
    then its steps take 16 and 24 sequences, the records saying so, and train on."""
    ramp, fixed = _load(results, "ref_ramp")["records"], _load(results, "ref")["records"]
    assert [r["global_batch_size"] for r in ramp] == [8, 8, 16, 24, 24, 24]
    assert [r["tokens_seen"] for r in ramp] == [32 * n for n in (8, 16, 32, 56, 80, 104)]
    assert "global_batch_size" not in fixed[0]
    assert [r["loss"] for r in ramp[:2]] == [r["loss"] for r in fixed[:2]]
    assert ramp[2]["loss"] != fixed[2]["loss"]
    assert _trains([r["loss"] for r in ramp])


def _validation_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r}


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.startswith("validation_")))
def test_validation_loss_matches_one_process(results, case):
    want = _validation_losses(_load(results, VALIDATION_REFERENCE[0])["records"])
    got = _validation_losses(_load(results, case)["records"])
    assert sorted(want) == [3, 6]
    assert got == pytest.approx(want, rel=1e-6)


def test_validation_leaves_no_trace(results):
    """Training with validations in between is bitwise training without them."""
    for with_validation, without in (("ref_validation", "ref"), ("validation_fsdp2", "fsdp2")):
        run, plain = _load(results, with_validation), _load(results, without)
        assert [r["loss"] for r in run["records"]] == [r["loss"] for r in plain["records"]]
        for name, want in plain["weights"].items():
            assert torch.equal(run["weights"][name], want), name


def test_validation_loss_is_the_mean_token_loss_of_the_whole_split(results):
    """By hand, from the final weights: the mean cross-entropy over every full batch of the
    bundled validation split (8 x 32 tokens; the last partial batch left out)."""
    from torchtitan.components.dataloader import build_dataloader
    from torchtitan.components.tokenizer import build_tokenizer
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.spec import get_model_spec

    run = _load(results, WHOLE_SPLIT[0])
    (record,) = [r for r in run["records"] if "validation_loss" in r]
    model = Transformer(get_model_spec("llama3").args_for("debugmodel", seq_len=32))
    model.load_state_dict(run["weights"])
    loader = build_dataloader(
        dataset="python_docs_validation", dataset_path=None, seq_len=32, local_batch_size=8,
        tokenizer=build_tokenizer(REPO / "tests/assets/tokenizer"), dp_rank=0, dp_world_size=1,
        infinite=False, drop_last=True,
    )  # fmt: skip
    total, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, labels in loader:
            logits = model(inputs["input"])
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).double(), labels.flatten(), reduction="sum"
            ).item()
            tokens += labels.numel()
    assert tokens == record["validation_tokens"] == 142 * 8 * 32
    assert record["validation_loss"] == pytest.approx(total / tokens, rel=1e-6)


def test_fsdp_gathers_float8_weights_as_bytes_with_the_same_numerics(results):
    """The float8 all-gather sends each block's float8 weights (one byte per value) where
    float32 took four, and trains exactly as casting after a float32 gather does."""
    gathered = _load(results, "float8_fsdp2_tensorwise_gathered")
    plain = _load(results, "float8_fsdp2_tensorwise")
    assert [r["loss"] for r in gathered["records"]] == [r["loss"] for r in plain["records"]]
    for name, want in plain["weights"].items():
        assert torch.equal(gathered["weights"][name], want), name
    sent, before = gathered["all_gather_bytes"], plain["all_gather_bytes"]
    assert set(before) == {"torch.float32"}
    # Blocks mix float8 weights with float32 norms: gathered as bytes (what gloo can move).
    assert sent["torch.uint8"] > 0
    # The root unit (embeddings, final norm, output: high precision) is gathered as before;
    # the blocks' linears shrink to a quarter, plus a few scales and norms.
    root = sent["torch.float32"]
    blocks_before = before["torch.float32"] - root
    assert 0.25 * blocks_before < sent["torch.uint8"] < 0.27 * blocks_before


def test_float8_tensor_parallel_styles_train_like_float8_fsdp(results):
    """torchao's float8 TP styles (the input of each region cast once) against FSDP 2 in
    float8 on the same global batches: the same float8 numerics up to summation order."""
    tp = [r["loss"] for r in _load(results, "float8_tp2")["records"]]
    fsdp = [r["loss"] for r in _load(results, "float8_fsdp2_tensorwise")["records"]]
    assert tp == pytest.approx(fsdp, rel=5e-4)  # measured: 1.4e-4


@pytest.mark.parametrize("case", sorted(FLOAT8_CASES))
def test_float8_trains_close_to_float32(results, case):
    losses = [r["loss"] for r in _load(results, case)["records"]]
    want = [r["loss"] for r in _load(results, "fsdp2")["records"]]
    assert _trains(losses)
    assert losses == pytest.approx(want, rel=0.02)


def test_replicated_parameters_stay_equal_on_every_rank(results):
    """Each rank updates its own copy of a replicated parameter (TP's norms, HSDP's and DDP's
    replicas): at the end of every layout the copies are equal, also under stochastic
    rounding, which draws the same bits for each copy."""
    cases = CASES | FLOAT8_CASES | BF16_CASES | BF16_SR_CASES
    saved = {case: _load(results, case) for case, (ranks, _) in cases.items() if ranks > 1}
    assert saved["bf16_sr_fsdp2_tp2"]["replicated"] > 0  # the norms, over the TP ranks
    differ = {case: s["replicas_differ"] for case, s in saved.items() if s["replicas_differ"]}
    assert not differ


@pytest.mark.parametrize("case", sorted(BF16_CASES))
def test_bf16_layout_trains_like_one_process_in_bf16(results, case):
    reference = BF16_MOE_REFERENCE if case.startswith("bf16_moe_") else BF16_REFERENCE
    ref, run = _load(results, reference[0]), _load(results, case)
    for got, want in zip(run["records"], ref["records"], strict=True):
        # measured: 6e-5 and 1e-4; the bf16 reference is 7e-4 away from the float32 one
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-4), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3), got["step"]
    assert run["weights"].keys() == ref["weights"].keys()
    for name, want in ref["weights"].items():
        got = run["weights"][name]
        assert got.dtype == want.dtype, name
        if name.endswith("expert_bias"):  # a float32 buffer, moved in steps of 0.01
            assert want.dtype == torch.float32, name
            # An expert whose count was near the mean moved one way here and the other there
            # (measured: one or two steps of one expert of one layer; the losses agree).
            torch.testing.assert_close(got, want, rtol=0, atol=0.021, msg=name)
            continue
        assert want.dtype == torch.bfloat16, name
        # measured: 4.9e-3 at most (a bf16 step of a weight above 0.5); the bf16 and the
        # float32 references end 1.6e-2 apart
        torch.testing.assert_close(got, want, rtol=0, atol=8e-3, msg=name)
    fp32 = _load(results, (MOE_REFERENCE if "moe" in case else REFERENCE)[0])["records"]
    assert ref["records"][-1]["loss"] != pytest.approx(fp32[-1]["loss"], rel=2e-4)


@pytest.mark.parametrize("case", sorted(BF16_SR_CASES))
def test_stochastic_rounding_trains_like_one_process_within_its_noise(results, case):
    """--optimizer.stochastic_rounding under FSDP 2 x TP 2 against one process: the bits are
    drawn per shard, so other weights round up than in one process, each step a bf16 step
    apart at most; losses and weights agree within that noise, and the TP-replicated norms,
    which rounding to nearest never moves at this LR (updates under half a bf16 step at
    1.0), move (and stay equal on both TP ranks: the test above)."""
    ref, run = _load(results, BF16_SR_REFERENCE[0]), _load(results, case)
    nearest = _load(results, BF16_REFERENCE[0])
    for got, want in zip(run["records"], ref["records"], strict=True):
        # measured: 2.3e-4 at most; rounding to nearest ends 5.7e-4 from the reference
        assert got["loss"] == pytest.approx(want["loss"], rel=5e-4), got["step"]
    for name, want in ref["weights"].items():
        # measured: 4 bf16 steps at most (a norm's weight at 1.0 rounded up 4 times in 6
        # steps here, not there), 1.1e-3 on average
        torch.testing.assert_close(run["weights"][name], want, rtol=0.05, atol=8e-3, msg=name)
    norms = [name for name in ref["weights"] if name.endswith("norm.weight")]
    for weights in (nearest["weights"], ref["weights"], run["weights"]):
        moved = sum(int((weights[name] != 1).sum()) for name in norms)
        assert moved > 100 if weights is not nearest["weights"] else moved == 0
