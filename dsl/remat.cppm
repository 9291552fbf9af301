// module remat: everything a trainer, test or benchmark uses from the DSL. The parts are modules
// of their own so that each dependent imports only what it needs (model modules the language,
// the model compiler the tensor rules, the runtime all three).
export module remat;
export import remat.language;
export import remat.tensors;
export import remat.planner;
