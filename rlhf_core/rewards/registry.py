"""Reward functions by data source, called the way verl's naive reward manager calls them, so a
verl user's function works unchanged:

    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> float | dict

``data_source`` is the value of the row's ``data.reward_fn_key`` column (verl's default key is
``data_source``); ``extra_info`` is the row's verl ``extra_info`` as a dict, with verl's two
additions ``num_turns`` (None: single-turn rollouts) and ``rollout_reward_scores`` ({}). A dict
result must hold ``"score"``; its other keys are kept (as JSON) in the scored table's
``reward_extra`` column. Three ways to provide a reward:

1. built in, as verl's ``default_compute_score``: ``openai/gsm8k`` → the GSM8K rule
   (``rewards.gsm8k``, verl's), and our ``gsm8k`` and ``arith`` (the embedded demo) → the same rule,
   configured by ``custom_reward_function.gsm8k_method`` / ``format_score`` / ``score`` (defaults
   verl's: strict, 0, 1); ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval`` and
   ``HuggingFaceH4/MATH-500`` → verl's MATH rule (``rewards.hendrycks_math``); ``math_dapo``,
   ``math``, ``math_dapo_reasoning`` and ``aime*`` → verl's DAPO rule (``rewards.dapo_math``).
   verl's other built-in sources (PRIME, code, geometry3k, search-R1: ``VERL_SOURCES_NOT_BUILT_IN``)
   are not built in here: their error says so;
2. ``@register_reward("my/source")`` on a function in code imported before scoring;
3. ``custom_reward_function.path`` (``pkg.module:function``, ``pkg.module`` + ``name``, or a ``.py``
   file + ``name``): as in verl, that one function then scores every row, whatever its data source.
   The user's code is imported only when this key is set, and runs in a process of its own
   (``rewards.user_process``): an exit of any kind, a crash, or a call longer than
   ``custom_reward_function.call_timeout_s`` is one error naming the function, never the run's end.
   An ``async def`` function is run to completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import math
from typing import Any, Callable, Iterator, Union

from rlhf_core.config import ConfigError
from rlhf_core.config.schema import CustomRewardConfig
from rlhf_core.data.schemas import decode_extra_info
from rlhf_core.errors import DataError
from rlhf_core.registry import Registry
from rlhf_core.rewards import dapo_math, gsm8k, hendrycks_math
from rlhf_core.rewards.user_process import UserProcess
from rlhf_core.rewards.user_process_main import plain

FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: rewards are stored as float32 (the scored table), so a larger
float64 score passes ``math.isfinite`` here and becomes inf there."""

RewardFn = Callable[..., Union[float, dict]]
"""compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict"""

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k", "arith")
"""verl routes 'openai/gsm8k' to its GSM8K rule; 'gsm8k' and 'arith' (the demo) are ours."""

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
"""verl routes these to its MATH rule (math_reward.py); so do we."""

DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
DAPO_PREFIX = "aime"
"""verl routes these, and every data source starting with 'aime', to its DAPO rule; so do we."""

VERL_SOURCES_NOT_BUILT_IN = {
    **dict.fromkeys(("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                     "numina_cn_k12", "numina_olympiads"), "prime_math"),
    **dict.fromkeys(("codecontests", "apps", "codeforces", "taco"), "prime_code / sandbox_fusion"),
    "hiyouga/geometry3k": "geo3k",
    **dict.fromkeys(("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle"), "search_r1_like_qa_em"),
}
"""data_source → the verl.utils.reward_score module verl's default_compute_score scores it with,
not built in here: PRIME's math grader (sympy-based) and code sandbox, geometry3k (mathruler), and
search-R1 (its ground truth is a dict of targets, and its rollouts call a search tool)."""

REWARDS: Registry[RewardFn] = Registry("reward function")
"""Reward functions registered by data source (``register_reward``); the built-in routes are not in
it: a registered function overrides a built-in of the same name (``_routes``)."""


def register_reward(*data_sources: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: route rows whose ``data_source`` is one of ``data_sources`` to the function."""
    if not data_sources:
        raise ValueError("register_reward needs at least one data_source name")

    def decorate(fn: RewardFn) -> RewardFn:
        for source in data_sources:
            REWARDS.register(source)(fn)
        return fn

    return decorate


def registered_sources() -> list[str]:
    """Every data_source that has a route (built-in and registered)."""
    built_in = {*GSM8K_SOURCES, *MATH_SOURCES, *DAPO_SOURCES, DAPO_PREFIX + "*"}
    return sorted(built_in | set(REWARDS.names()))


def _gsm8k_route(c: CustomRewardConfig) -> RewardFn:
    def score_gsm8k(data_source, solution_str, ground_truth, extra_info=None):
        return gsm8k.compute_score(solution_str, ground_truth, method=c.gsm8k_method,
                                   format_score=c.format_score, score=c.score)

    return score_gsm8k


def _score_math(data_source, solution_str, ground_truth, extra_info=None):
    return hendrycks_math.compute_score(solution_str, ground_truth)


def _score_dapo(data_source, solution_str, ground_truth, extra_info=None):
    return dapo_math.compute_score(solution_str, ground_truth)


def _routes(settings: CustomRewardConfig) -> dict[str, RewardFn]:
    routes = {source: _gsm8k_route(settings) for source in GSM8K_SOURCES}
    routes.update(dict.fromkeys(MATH_SOURCES, _score_math))
    routes.update(dict.fromkeys(DAPO_SOURCES, _score_dapo))
    routes.update(REWARDS.entries())  # a registered function overrides a built-in of the same name
    return routes


def _unrouted(data_source, routes: dict[str, RewardFn]) -> DataError:
    module = VERL_SOURCES_NOT_BUILT_IN.get(data_source)
    known = (f"verl scores it with verl.utils.reward_score.{module}, which is not built in here; "
             if module else "")
    return DataError(
        f"no reward function for data_source {data_source!r}; {known}registered: {', '.join(sorted(routes))}. "
        "Register one with @rlhf_core.rewards.register_reward('<data_source>') in code imported "
        "before scoring, or set custom_reward_function.path=<pkg.module:function | /path/file.py> "
        "(and custom_reward_function.name) to score every row with your own compute_score"
    )


def _route(routes: dict[str, RewardFn], data_source, solution_str, ground_truth, extra_info=None):
    fn = routes.get(data_source)
    if fn is None and str(data_source).startswith(DAPO_PREFIX):
        fn = _score_dapo
    if fn is None:
        raise _unrouted(data_source, routes)
    return fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)


def routing_value(*rows: dict, key: str, where: str) -> Any:
    """The value that picks a row's reward function: ``reward_source`` (preprocess's value of the
    data.reward_fn_key column, carried into every table) of the first of ``rows`` that holds one.
    ``rows``: the response's row, then its prompt's; ``where`` names the row in the error."""
    for row in rows:
        if row.get("reward_source") is not None:
            return row["reward_source"]
    raise ConfigError(f"data.reward_fn_key={key!r}: {where} has no value in column {key!r}; name a column of "
                      "the prompt files (verl's default: data_source) and rerun preprocess")


def verl_extra_info(extra_info: Any) -> dict:
    """The ``extra_info`` dict verl's naive reward manager passes: the row's extra_info (a dict, or
    the JSON text the tables store; absent = {}) plus ``num_turns`` (None: one turn) and
    ``rollout_reward_scores`` ({})."""
    if isinstance(extra_info, str):
        extra_info = decode_extra_info(extra_info.strip())
    info = dict(extra_info or {})
    info["num_turns"] = None
    info["rollout_reward_scores"] = {}
    return info


def _call_verl_style(fn: RewardFn, data_source, solution_str, ground_truth, extra_info=None):
    """Call ``fn`` (built in or registered: in this process) with verl's keyword arguments; an
    ``async def`` function is run to completion. A function that calls ``sys.exit`` would end the
    whole run, with its exit status (0: a run that stops silently and reports success): that is a
    ``DataError`` here."""
    try:
        result = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                    extra_info=verl_extra_info(extra_info))
        return asyncio.run(result) if inspect.iscoroutine(result) else result
    except SystemExit as exc:
        raise DataError(f"the reward function {getattr(fn, '__name__', fn)!r} called sys.exit({exc.code!r}), "
                        "which would end the run; return a score (raise an exception for an error)") from None


class UserReward:
    """custom_reward_function.path's function, called in a process of its own
    (``rewards.user_process``) with verl's keyword arguments and extra_info: its exit, crash or hang
    is a ``DataError`` naming it, never the run's end. ``close()`` ends its process."""

    def __init__(self, settings: CustomRewardConfig):
        self.process = UserProcess(settings.path, settings.name, settings.call_timeout_s)

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        return self.process.call(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                                 extra_info=verl_extra_info(extra_info))

    def close(self) -> None:
        self.process.close()


def get_reward_fn(settings: CustomRewardConfig) -> RewardFn:
    """The callable that scores one response, ``fn(data_source, solution_str, ground_truth,
    extra_info=None)``: the user's function when ``settings.path`` (custom_reward_function.path) is
    set (``UserReward``: its module imported now, in its own process, and only then), else the
    router over built-in and registered routes (in this process). Either is called with verl's
    keyword arguments and verl's extra_info (``verl_extra_info``). ``reward_function`` closes it."""
    if settings.path:
        return UserReward(settings)
    return functools.partial(_call_verl_style, functools.partial(_route, _routes(settings)))


@contextlib.contextmanager
def reward_function(settings: CustomRewardConfig) -> Iterator[RewardFn]:
    """``get_reward_fn(settings)`` for the length of the block; a user function's process ends with it."""
    fn = get_reward_fn(settings)
    try:
        yield fn
    finally:
        if isinstance(fn, UserReward):
            fn.close()


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------


def normalize_result(result: Any, where: str) -> tuple[float, str]:
    """(score, reward_extra JSON) from a float / int / bool / dict result; ``where`` names the row."""
    extra: dict = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise DataError(f"{where}: the reward function returned a dict without 'score' "
                            f"(keys: {', '.join(map(str, result))}); a dict result must hold 'score'")
        extra = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    if isinstance(result, (list, tuple)) and result:  # verl tolerates a (score, ...) sequence
        result = result[0]
    try:
        score = float(result)
    except (TypeError, ValueError):
        raise DataError(f"{where}: the reward function returned {result!r}; return a number or a "
                        "dict with a numeric 'score'") from None
    except OverflowError:  # an int beyond any float, e.g. 10**400
        raise DataError(f"{where}: the reward function returned an integer of {int(result).bit_length()} bits, "
                        f"beyond float32's range (±{FLOAT32_MAX:.4g}) in which the tables store rewards; "
                        "return a score of a sensible scale") from None
    if not math.isfinite(score):
        raise DataError(f"{where}: the reward function returned a non-finite score ({score}); "
                        "NaN or inf would poison the advantages")
    if abs(score) > FLOAT32_MAX:
        raise DataError(f"{where}: the reward function returned {score:g}, beyond float32's range (±{FLOAT32_MAX:.4g}) "
                        "in which the tables store rewards: it would be stored as inf and poison the advantages; "
                        "return a score of a sensible scale")
    return score, json.dumps(extra, sort_keys=True, default=_plain_or_text)


def _plain_or_text(value: Any) -> Any:
    """A numpy or torch value as the number or list it holds, as a user function's result crosses
    from its own process (``user_process_main.plain``); anything else as its text."""
    try:
        return plain(value)
    except TypeError:
        return str(value)
