"""Policies. Registry: POLICIES maps model.policy to a builder `(cfg: Config) -> Policy` (imported lazily)."""

from mmrl.registry import Registry

POLICIES = Registry("policy")


@POLICIES.register("flow")
def _flow(cfg):
    from mmrl.policy.flow import build_flow_policy

    return build_flow_policy(cfg)


@POLICIES.register("vlm")
def _vlm(cfg):
    from mmrl.policy.vlm import build_token_policy

    return build_token_policy(cfg)
