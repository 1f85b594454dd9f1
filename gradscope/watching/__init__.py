"""``gradscope.watch(model)``: the training guard. ``guard`` owns the hooks; ``step`` holds the pure checks
and the wording of what they find."""
