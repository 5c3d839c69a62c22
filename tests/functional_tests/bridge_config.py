"""Test-only: the small Megatron-Bridge ``ConfigContainer`` the functional tests train (the stock-loop script on CPU,
the L2 ``pretrain()`` test on GPUs): a model provider, mock GPT data, Adam at a constant rate, no checkpoints."""


def small_config(
    model,
    *,
    steps: int,
    global_batch: int,
    micro_batch: int,
    seq: int,
    vocab: int,
    lr: float,
    bf16_optimizer: bool,
    clip_grad: float,
    grad_reduce_in_fp32: bool,
    dist: dict,
    log_interval: int = 100,
):
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
    )

    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=steps, global_batch_size=global_batch, micro_batch_size=micro_batch),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=0.0,
            bf16=bf16_optimizer,
            use_distributed_optimizer=False,
            clip_grad=clip_grad,
            weight_decay=0.0,
        ),  # fmt: skip
        scheduler=SchedulerConfig(
            lr_decay_style="constant",
            lr_warmup_iters=0,
            start_weight_decay=0.0,
            end_weight_decay=0.0,
            weight_decay_incr_style="constant",
        ),  # fmt: skip
        ddp=DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=False),
        dataset=MockGPTDatasetConfig(
            random_seed=1234,
            seq_length=seq,
            reset_attention_mask=False,
            reset_position_ids=False,
            eod_mask_loss=False,
            num_workers=0,
        ),  # fmt: skip
        logger=LoggerConfig(log_interval=log_interval),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=vocab),
        checkpoint=CheckpointConfig(),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(**dist),
    )
