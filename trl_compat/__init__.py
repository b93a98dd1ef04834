"""TRL's names for our flags and its reward-function extras.

    trl_names.py      GRPOConfig's names and TRL's recipe files (--config a TRL YAML)
    reward_extras.py  trainer_state, log_metric, log_extra and async rewards
"""
