"""`python -m specdec train`: drafts for a target, trained on the target's own outputs.

- prompts.py: the training instructions (templates) and the held-out measuring prompts;
- data.py: self-distillation through the engine (+ teacher-forced package text);
- features.py: target features and top-K labels, computed once;
- batches.py, ttt.py, loop.py, checkpoint.py: batches and loss, training-time-test
  attention, the shared loop (budget, schedule, resume), export in published layouts;
- eagle3_trainer.py, eagle_trainer.py, draft_model_trainer.py: one per method;
- card.py: the README.md next to a shipped draft; cli.py: the command.
"""
