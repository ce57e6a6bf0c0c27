"""Training, which the core never imports: drafter data (ShareGPT, task prompts, the
target's own answers), features, the EAGLE-2, EAGLE-3 and Medusa trainers, SpecVocab's ranker."""
