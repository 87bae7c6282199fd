"""Reward routing by data_source, user functions (module:function and file path), dict results."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_core.errors import DataError
from rlhf_core.rewards import get_reward_fn, normalize_result, register_reward, registered_sources
from rlhf_core.rewards import registry
from rlhf_core.registry import Registry


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "REWARDS", Registry("reward function"))


@pytest.mark.parametrize("source", ["openai/gsm8k", "gsm8k", "arith"])
def test_builtin_gsm8k_routes_use_the_configured_method(source):
    strict = get_reward_fn(load_config(None, []).custom_reward_function)
    flexible = get_reward_fn(load_config(None, ["custom_reward_function.gsm8k_method=flexible",
                                                "custom_reward_function.format_score=0.1"]).custom_reward_function)
    assert strict(source, "#### 12", "12") == 1.0
    assert strict(source, "The answer is 12", "12") == 0.0
    assert flexible(source, "The answer is 12", "12") == 1.0
    assert flexible(source, "The answer is 13", "12", None) == 0.1


def test_verl_routes_only_openai_gsm8k_to_the_gsm8k_rule_and_we_add_two_names():
    fn = get_reward_fn(load_config(None, []).custom_reward_function)
    assert [fn(s, "so #### 1,234", "1234") for s in registry.GSM8K_SOURCES] == [1.0, 1.0, 1.0]
    assert fn("openai/gsm8k", "#### 72\n#### 5", "5") == 1.0  # verl's rule: the last marker


@pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"])
def test_verls_math_sources_route_to_the_math_rule(source):
    fn = get_reward_fn(load_config(None, []).custom_reward_function)
    assert fn(source, "so the answer is $\\boxed{\\dfrac12}$", "\\frac{1}{2}") == 1.0
    assert fn(source, "so the answer is 1/2", "\\frac{1}{2}") == 0.0  # no box
    assert source in registered_sources()


@pytest.mark.parametrize("source", ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime"])
def test_verls_dapo_sources_route_to_the_dapo_rule(source):
    fn = get_reward_fn(load_config(None, []).custom_reward_function)
    assert fn(source, "so... Answer: $1,000$", "1000") == {"score": 1.0, "acc": True, "pred": "1000"}
    assert fn(source, "no final line", "7") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}


@pytest.mark.parametrize("source,module", [("numina_cn_k12", "prime_math"), ("taco", "prime_code"),
                                           ("hiyouga/geometry3k", "geo3k"), ("searchR1_nq", "search_r1")])
def test_verl_sources_not_built_in_say_which_verl_scorer_they_need(source, module):
    fn = get_reward_fn(load_config(None, []).custom_reward_function)
    with pytest.raises(DataError, match=f"verl scores it with verl.utils.reward_score.{module}.*not built in"):
        fn(source, "x", "y")


def test_user_function_is_called_with_verls_keywords_and_extra_info(tmp_path):
    file = tmp_path / "kw.py"
    file.write_text(textwrap.dedent("""
        import asyncio
        def compute_score(*, data_source, solution_str, ground_truth, extra_info):
            return {"score": 1.0, "info": extra_info, "source": data_source}
        async def later(data_source, solution_str, ground_truth, extra_info=None):
            await asyncio.sleep(0)
            return 0.75
    """))
    fn = get_reward_fn(load_config(None, [f"custom_reward_function.path={file}"]).custom_reward_function)
    result = fn("src", "text", "gt", '{"index": 4, "split": "train"}')  # extra_info as JSON text: decoded
    assert result["info"] == {"index": 4, "split": "train", "num_turns": None, "rollout_reward_scores": {}}
    assert result["source"] == "src"
    assert get_reward_fn(load_config(None, [f"custom_reward_function.path={file}:later"]).custom_reward_function)("a", "b", "c") == 0.75


def test_unknown_data_source_lists_routes_and_says_how_to_add_one():
    fn = get_reward_fn(load_config(None, []).custom_reward_function)
    with pytest.raises(DataError) as err:
        fn("my/dataset", "x", "y")
    message = str(err.value)
    assert "'my/dataset'" in message and "openai/gsm8k" in message and "verl scores it" not in message
    assert "register_reward" in message and "custom_reward_function.path" in message


def test_registered_function_gets_verl_arguments_and_overrides_builtin():
    seen = []

    @register_reward("my/dataset", "arith")
    def exact(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, extra_info))
        return float(solution_str.strip() == ground_truth)

    fn = get_reward_fn(load_config(None, []).custom_reward_function)
    assert fn("my/dataset", " yes ", "yes", {"index": 3}) == 1.0
    assert fn("arith", "#### 12", "12") == 0.0  # the registered function now owns 'arith'
    # verl's naive reward manager adds num_turns and rollout_reward_scores to the row's extra_info
    assert seen == [("my/dataset", {"index": 3, "num_turns": None, "rollout_reward_scores": {}}),
                    ("arith", {"num_turns": None, "rollout_reward_scores": {}})]
    assert {"my/dataset", "openai/gsm8k"} <= set(registered_sources())


USER_MODULE = textwrap.dedent("""
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5 if data_source == "anything" else 0.25, "length": len(solution_str)}

    def other(data_source, solution_str, ground_truth, extra_info=None):
        return 2
""")


def test_user_function_from_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        fn = get_reward_fn(load_config(None, ["custom_reward_function.path=my_rewards_mod:other"]).custom_reward_function)
        assert fn("openai/gsm8k", "x", "y") == 2  # the user's function scores every data source
        fn = get_reward_fn(load_config(None, ["custom_reward_function.path=my_rewards_mod"]).custom_reward_function)
        assert fn("anything", "abc", "y") == {"score": 0.5, "length": 3}
    finally:
        sys.modules.pop("my_rewards_mod", None)


def test_user_function_from_file_path_with_name(tmp_path):
    file = tmp_path / "reward.py"
    file.write_text(USER_MODULE)
    fn = get_reward_fn(load_config(None, [f"custom_reward_function.path={file}",
                                          "custom_reward_function.name=other"]).custom_reward_function)
    assert fn("x", "y", "z") == 2
    fn = get_reward_fn(load_config(None, [f"custom_reward_function.path={file}:compute_score"]).custom_reward_function)
    assert fn("x", "hello", "z")["length"] == 5


def test_user_code_is_not_imported_unless_configured(tmp_path):
    """A reward file that leaves a marker when imported: an unset path never executes it."""
    marker = tmp_path / "imported.txt"
    file = tmp_path / "side_effect.py"
    file.write_text(f"open({str(marker)!r}, 'w').write('x')\n" + USER_MODULE)
    get_reward_fn(load_config(None, []).custom_reward_function)("arith", "#### 1", "1")
    assert not marker.exists()
    get_reward_fn(load_config(None, [f"custom_reward_function.path={file}"]).custom_reward_function)
    assert marker.exists()  # the test can fail: configured, it is imported


def test_user_function_errors_name_the_key_and_the_fix(tmp_path):
    file = tmp_path / "reward.py"
    file.write_text(USER_MODULE)
    with pytest.raises(ConfigError, match="custom_reward_function.name to one of: compute_score, other"):
        get_reward_fn(load_config(None, [f"custom_reward_function.path={file}",
                                         "custom_reward_function.name=missing"]).custom_reward_function)
    with pytest.raises(ConfigError, match="not found"):
        get_reward_fn(load_config(None, [f"custom_reward_function.path={tmp_path / 'nope.py'}"]).custom_reward_function)
    with pytest.raises(ConfigError, match="cannot import module"):
        get_reward_fn(load_config(None, ["custom_reward_function.path=no_such_pkg.rewards:fn"]).custom_reward_function)


def test_normalize_result():
    assert normalize_result(1, "row 0") == (1.0, "{}")
    assert normalize_result(True, "row 0") == (1.0, "{}")
    score, extra = normalize_result({"score": 0.5, "acc": True, "pred": "18"}, "row 0")
    assert score == 0.5 and json.loads(extra) == {"acc": True, "pred": "18"}
    with pytest.raises(DataError, match="row 7.*without 'score'"):
        normalize_result({"acc": 1.0}, "row 7")
    with pytest.raises(DataError, match="non-finite"):
        normalize_result(float("nan"), "row 1")
    with pytest.raises(DataError, match="return a number"):
        normalize_result("high", "row 2")
    assert normalize_result(-3.0e38, "row 3")[0] == -3.0e38  # within float32
    with pytest.raises(DataError, match=r"row 4: .*returned -1e\+300, beyond float32's range"):
        normalize_result(-1e300, "row 4")  # finite in float64, -inf in the float32 table


def test_a_reward_function_that_calls_sys_exit_is_a_data_error(tmp_path):
    path = tmp_path / "leaving.py"
    path.write_text("import sys\n\ndef compute_score(**kwargs):\n    sys.exit(0)\n")
    fn = get_reward_fn(load_config(None, [f"custom_reward_function.path={path}"]).custom_reward_function)
    with pytest.raises(DataError, match=r"'compute_score' of .*leaving.py called sys.exit\(0\), which would end the run"):
        fn("arith", "#### 1", "1")


def test_routing_value_is_the_first_reward_source():
    from rlhf_core.rewards import routing_value

    row, prompt = {"reward_source": None, "data_source": "arith"}, {"reward_source": "math", "ability": "x"}
    assert routing_value(row, prompt, key="ability", where="r") == "math"  # the prompt's reward_source
    assert routing_value({"reward_source": "a"}, prompt, key="ability", where="r") == "a"
    with pytest.raises(ConfigError, match="data.reward_fn_key='ability': row 3 has no value"):
        routing_value(row, {"ability": "x"}, key="ability", where="row 3")  # the column alone does not route


def test_validation_names_the_prompt_whose_reward_function_called_sys_exit(tmp_path):
    from types import SimpleNamespace

    from rlhf_core.stages.validate import score_samples

    path = tmp_path / "leaving.py"
    path.write_text("import sys\n\ndef compute_score(**kwargs):\n    sys.exit(3)\n")
    cfg = load_config(None, [f"custom_reward_function.path={path}"])
    rows = [{"prompt_id": "p7", "data_source": "arith", "reward_source": "arith", "reward_model": {"ground_truth": "1"}}]
    with pytest.raises(DataError, match=r"^validation prompt p7: the reward function 'compute_score' of .*leaving.py "
                                        r"called sys.exit\(3\)"):
        score_samples(cfg.custom_reward_function, cfg.data.reward_fn_key, rows,
                      [SimpleNamespace(prompt_index=0, text="#### 1")])
