"""The pass runner: what passes a method's trace takes (:class:`~.pass_plan.PassPlan`) and the one
loop that runs them, for a classifier's batch and for each explained generation step.
"""
