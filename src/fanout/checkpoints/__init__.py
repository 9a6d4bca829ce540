"""Draft checkpoints, every family's: where they are, what they hold, how they are
written, resumed, loaded for serving and upgraded. One module per question:

    layout    names and finding: `latest_checkpoint`, `committed_checkpoints`, the training
              config a checkpoint records (`read_training_config`); no torch
    format    config.json: the speculators config an engine reads + fanout's section
              (`speculators_config`, `read_config`, `check_format`, `checkpoint_family`)
    save      `save_checkpoint`: write, commit, prune
    resume    `load_checkpoint`: restore a trainer's draft, optimizer, RNGs, states
    load      `load_draft`: a draft for inference from the served files alone
    upgrade   `fanout upgrade-checkpoint`: format 1 -> 2, unsorted layers -> ascending

Layout of `<save_dir>/checkpoint-<step:08d>/` (each family writes the speculators config
its vLLM / speculators counterpart reads; `speculators_model_type` names the family):
- `config.json`          the family's speculators config (`speculators_model_type`,
                         `transformer_layer_config`, its layer-ids field in serving
                         numbering, `draft_vocab_size`, the family's own fields, ...) plus a
                         `fanout` section: format version, family, the draft config in
                         fanout's numbering, train-time numbers (`train_eal`);
- `model.safetensors`    the served weights in bf16 under speculators keys (the weight
                         average under --ema-decay), and `lm_head.weight`/`d2t`/`t2d` for a
                         reduced draft vocabulary;
- `resume.safetensors`   the weights at training precision (bf16 rounding would change the
                         next step), optimizer tensors (`opt.<param>.<name>`), RNG states
                         (`rng.<name>`), the weight average (`ema.<name>`);
- `optimizer.json`       optimizer param groups and scalar state;
- `training_state.json`  the trainer's dict (step, ...) and each of `states`' state_dict
                         under its name (`stream`: cursor, rows_done; `scheduler`);
- `training_config.json` the trainer's whole validated config (seed, rows per step, lr,
                         schedule, recipe, ...; fanout.train.config.TrainConfig.recorded),
                         which a resume checks its flags against;
- `COMMITTED`            written last. A directory without it is debris, never loaded.

Atomicity: everything is written into `<save_dir>/.tmp-<name>-<temp_tag()>/`, each file
fsynced (`FileSystem.write_new`), the directory renamed to its final name and the parent
fsynced (`FileSystem.commit_dir`), then `COMMITTED` written atomically
(`FileSystem.write_atomic`). Every step goes through the FileSystem seam, so tests inject
faults into it. The newest `keep` (>= 2) committed checkpoints are kept, and always the
one just written. No pickle.

Between the families it writes and the commands that read it (decode: `fanout eval`,
`fanout promote`; train: save and resume), so a reader never imports the trainer.

May import: families, model and the core.
"""
