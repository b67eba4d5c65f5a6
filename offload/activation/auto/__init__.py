"""Auto mode of activation offload: measure the first steps of each input shape, plan which
layers to offload (or keep, or recompute for a memory budget), check the plan against timed
steps. See docs/design/activation.md.

Built on the runtime (offload/activation/: the handle, the engine) through its documented
interfaces (Note [handle interface] in ../api.py, Note [engine interface] in ../engine.py);
the runtime imports nothing of this package but `planner.AutoPlanner`, which
`ActivationOffload.__init__` imports when mode='auto'. Nothing is imported here, so loading
one module of the package loads only what that module needs.

`AutoPlanner` is built from parts, each handed one `Shared` record (shared.py): the step
measurer (measure.py), the prober (probes.py) and the budget checker (budget_checks.py).

Modules:
- planner: `AutoPlanner`, what each step of a shape runs, and the plan made from its measured steps.
- shared: what the planner's parts share: the `Shared` record, the `Clock`, the copies' rate.
- plan: one shape's plan as a typed record (`Plan`), and the dict `handle.plan` gives of it.
- measure: a measured step: the engine's observer while measuring (`StepMeasurer`), and the
  layer times, bytes, marks and memory the plan reads from it (`MeasuredStep`).
- memory: a measured step's device memory, stretch by stretch; the allocator's cache given
  back as a plan settles.
- schedule: the plan without a budget: which layers' copies run when, and the points each
  group is let go and fetched back at (pure functions).
- probes: the plan without a budget checked against timed steps (`Prober`).
- search: the verdict on one probed count and the search over counts (pure functions of step times).
- budget: the budget model: keep / offload / recompute per layer for a memory budget (pure functions).
- budget_plan: one shape's budget plan: its inputs from the measured step, and the verdict on
  its timed steps (`BudgetRun`).
- budget_checks: timing the budget plan's steps and acting on the verdict (`BudgetChecker`).
- ranks: the measurements every decision is made from, combined across a process group's ranks.
"""
