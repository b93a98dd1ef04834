"""The built-in rewards beyond the default run's two (reward.py holds
exact_match_reward and final_number_reward), each imported when --rewards names
it (reward.REWARD_FUNCS):

    math_answers.py   accuracy_reward, reasoning_accuracy_reward (math-verify)
    think_format.py   think_format_reward (<think>...</think>answer)
    reward_model.py   get_reward_model_func: a learned reward model
    ../tools/sandbox.py  code_reward: tests run in the sandbox

Each is fn(completions, **columns) -> list[float | None], reward.py's contract.
"""
