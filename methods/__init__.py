"""Real decoding with torch + transformers, in floors; a module imports only from its own floor or below
(tests/test_layering.py checks it, lazy imports included):

0. core/         the Drafter protocol, engine, lean forward, the one decode loop, verifiers, samplers, timer
1. data/         the standard-library corpus and the workloads' prompts
2. zoo/, models  building the embedded model zoo; loading target and draft (zoo, hub, local, random)
3. heads/        modules trained on a frozen target (Medusa, EAGLE, MTP) and their one trainer
4. drafters/     one file per method, and the registry that names them
5. measurement/  calibration, device profiles and the simulator's view of them, task=measure, vLLM
"""
