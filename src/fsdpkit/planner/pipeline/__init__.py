"""Pipeline parallelism in the plan (``parallel.pp``: the axis's one planner folder).

plan        [Note: pipeline plans]: each pp rank's memory, the bubble, the traffic
replay      one pp rank's step replayed action by action as torch's schedule runs it
traced      [Note: traced pipeline plans]: each pp rank's stages traced under torch's schedule
zerobubble  the zero-bubble schedules' split backward as events
tied        [Note: tied stages in the plan]
report      how a pipelined plan reads (formatting only)
degrees     [Note: pipeline in the recommender]: the pp degrees tried, their step estimate
"""
