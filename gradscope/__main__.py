"""``python -m gradscope``: the same commands as the ``gradscope`` console script."""

from gradscope.cli.commands import main

if __name__ == "__main__":
    main(prog_name="gradscope")
