"""A CLI TARGET for the plan tests: the traced forward of ``_plan_models.gpt`` (seeded)."""

import torch

from tests._plan_models import gpt


def make():
    torch.manual_seed(0)
    model, (idx,), loss_fn = gpt()
    return loss_fn(model, idx), model
