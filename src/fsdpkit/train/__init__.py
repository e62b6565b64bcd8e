"""The training job behind ``fsdpkit train``: one worker per rank."""
