"""Floor 1, data: the standard-library corpus split by module (corpus) and the prompts of every workload
(workloads). Imports nothing from methods' upper floors."""
