"""The parameter servers' optimizer configuration for a torch optimizer (tandem.torch's server modes)."""

import torch


def optimizer_text(opt, mode, groups, max_grad_norm, non_finite, lr_schedule):
    """The servers' OptimizerConfig (protobuf text format) for a torch optimizer."""
    kind = type(opt)
    name = f"{kind.__module__}.{kind.__qualname__}"
    pg = opt.param_groups
    first = pg[0]

    def refuse(key, why):
        raise ValueError(f"{name}: {key} {why}: the parameter servers cannot honour it (use mode='allreduce' to run "
                         f"the optimizer locally)")

    def same(key):
        for i, g in enumerate(pg[1:], 1):
            if g.get(key) != first.get(key):
                refuse(
                    f"param_groups[{i}]['{key}'] = {g.get(key)!r}",
                    f"differs from param_groups[0]'s {first.get(key)!r} (the servers apply one value per job; only "
                    f"lr and weight_decay may differ between groups)",
                )

    for g in pg:
        if g.get("maximize", False):
            refuse("maximize=True", "is set")
    if isinstance(opt, torch.optim.SGD):
        for key in ("momentum", "nesterov", "dampening"):
            same(key)
        if first.get("dampening", 0) != 0:
            refuse(f"dampening={first['dampening']}", "is not 0")
        rule = "sgd {{ lr: {lr!r} momentum: {m!r} nesterov: {n} weight_decay: {wd!r} }}".format(
            lr=float(first["lr"]),
            m=float(first.get("momentum", 0.0)),
            n="true" if first.get("nesterov", False) else "false",
            wd=float(first.get("weight_decay", 0.0)),
        )
    elif isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        for key in ("betas", "eps", "amsgrad"):
            same(key)
        if first.get("amsgrad", False):
            refuse("amsgrad=True", "is set")
        decoupled = isinstance(opt, torch.optim.AdamW)
        b1, b2 = first["betas"]
        rule = (
            "adam {{ lr: {lr!r} beta1: {b1!r} beta2: {b2!r} eps: {eps!r} weight_decay: {wd!r} "
            "decoupled_weight_decay: {d} bias_correction: true }}"
        ).format(
            lr=float(first["lr"]),
            b1=float(b1),
            b2=float(b2),
            eps=float(first["eps"]),
            wd=float(first.get("weight_decay", 0.0)),
            d="true" if decoupled else "false",
        )
    else:
        raise TypeError(
            f"{name} is not an optimizer the parameter servers run (torch.optim.SGD, Adam and AdamW): use "
            f"mode='allreduce' to run it locally on every worker"
        )
    text = [rule, "reduction: GRADIENT_REDUCTION_SUM"]
    base_lr = float(first["lr"])
    base_wd = float(first.get("weight_decay", 0.0))
    for i, g in enumerate(pg):
        if i == 0 or g["params"] == []:
            continue
        overrides = []
        lr = float(g["lr"])
        if lr != base_lr:
            if base_lr <= 0:
                raise ValueError(f"{name}: param_groups[0]['lr'] is {base_lr}, so param_groups[{i}]'s lr {lr} "
                                 "cannot be a multiple of it")
            overrides.append(f"lr_scale: {lr / base_lr!r}")
        if float(g.get("weight_decay", 0.0)) != base_wd:
            overrides.append(f"weight_decay: {float(g.get('weight_decay', 0.0))!r}")
        if overrides:
            text.append(f'group_overrides {{ key: "{groups[i]}" value {{ {" ".join(overrides)} }} }}')
    if max_grad_norm:
        text.append(f"max_grad_norm: {float(max_grad_norm)!r}")
    text.append(
        "non_finite_policy: " + ("NON_FINITE_POLICY_FAIL" if non_finite == "fail" else "NON_FINITE_POLICY_SKIP_STEP")
    )
    if lr_schedule:
        kinds = {"constant": "CONSTANT", "cosine": "COSINE", "linear": "LINEAR"}
        kind_name = lr_schedule.get("kind", "constant")
        if kind_name not in kinds:
            raise ValueError(f"lr_schedule['kind'] = {kind_name!r} is not one of {', '.join(kinds)}")
        text.append(
            "lr_schedule {{ kind: LR_SCHEDULE_KIND_{k} warmup_steps: {w} total_steps: {t} min_lr_ratio: {r!r} }}".format(
                k=kinds[kind_name],
                w=int(lr_schedule.get("warmup_steps", 0)),
                t=int(lr_schedule.get("total_steps", 0)),
                r=float(lr_schedule.get("min_lr_ratio", 0.0)),
            )
        )
    return "\n".join(text)
