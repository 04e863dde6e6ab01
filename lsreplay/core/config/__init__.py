"""Typed run configuration: a dataclass schema, YAML + `key=value` overrides, validation.

Every error names the key and what is allowed, and is raised before any work starts. One
concern a file:

- schema.py          Config: the top-level keys and one section per concern, each key with
                     its comment; the sections in
  model.py           model (and model.lora)
  data.py            data, reward, eval (and what a reward spec names)
  rollout.py         rollout (and rollout.vllm), drafter (and an episode's length bounds)
  training.py        algo, optim, replay
  runtime.py         checkpoint, storage, pool, tracking, limits, sandbox
- loading.py         load_config / from_dict: defaults <- YAML <- overrides, TRL's spellings,
                     unknown keys named with their fix (aliases.py: TRL's and verl's names)
- validation.py      validate: one function per section
- serialization.py   to_dict / to_yaml (redacted), result_hash, and the trust classification
                     of every key a resume reads (COMMAND_KEYS, PLAIN_TEXT_KEYS)

Import from here: `from lsreplay.core.config import Config, load_config, ...`.
"""

from lsreplay.core.config.data import (ANSWER_INSTRUCTION, EXAMPLE_ROLES, PROMPT_TRUNCATIONS, REWARD_STYLES,
                                       SYSTEM_PROMPT, ColumnsConfig, DataConfig, EvalConfig, RewardConfig,
                                       is_import_path, is_reward_model, reward_specs)
from lsreplay.core.config.loading import (FREE_DICTS, dotted_leaves, from_dict, load_config, schema_keys,
                                          settle)
from lsreplay.core.config.model import (ALL_LINEAR, DTYPES, PROJECTIONS, ROPE_SCALINGS, SMOLLM2, LoraConfig,
                                        ModelConfig)
from lsreplay.core.config.rollout import (BRANCH_AT, ENGINES, TOOL_CALL_FORMATS, VLLM_MAX_LORA_RANK, DrafterConfig,
                                          RolloutConfig, VLLMConfig, completion_tokens, model_token_budget,
                                          multi_turn)
from lsreplay.core.config.runtime import (ACCELERATORS, TRACKERS, CheckpointConfig, LimitsConfig, PoolConfig,
                                          SandboxConfig, StorageConfig, TrackingConfig, tracker_install_hint)
from lsreplay.core.config.schema import Config, ConfigError
from lsreplay.core.config.serialization import (COMMAND_KEYS, CREDENTIAL_URL_KEYS, NON_RESULT_KEYS, PLAIN_TEXT_KEYS,
                                                REDACTED, SECRET_KEYS, SECRET_NAME, command_keys, has_credentials,
                                                non_result_keys, redact_url, result_hash, to_dict, to_yaml)
from lsreplay.core.config.training import (ADVANTAGES, ALGOS, DPO_SOURCES, DYNAMIC_SAMPLING_METRICS, KL_ESTIMATORS,
                                           LOSS_AGGS, OVERLONG, SCALE_REWARDS, SCALE_REWARDS_BOOLEANS, SCHEDULES,
                                           TREE_BASELINES, AlgoConfig, OptimConfig, ReplayConfig)
from lsreplay.core.config.validation import validate
