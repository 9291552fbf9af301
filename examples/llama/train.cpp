// Trains the Llama-style character model of llama.cppm on the fortune cookie corpus (Debian's
// `fortunes`) with the shared remat trainer, then prints a generated sample.
import remat.trainer;
import llama;
import llama.kernels;
import remat;

// Known at compile time: selective saves less than none, full less than selective.
static_assert(remat::make_plan(llama::model, remat::selective, llama::default_batch).activation_bytes <
              remat::make_plan(llama::model, remat::none, llama::default_batch).activation_bytes);
static_assert(remat::make_plan(llama::model, remat::full, llama::default_batch).activation_bytes <
              remat::make_plan(llama::model, remat::selective, llama::default_batch).activation_bytes);

int main(int argc, char **argv) {
  return remat::runtime::train_main(argc, argv,
                                    {.name = "llama",
                                     .model = llama::model,
                                     .default_policy = llama::policy,
                                     .kernels = llama_kernels::table,
                                     .cuda_kernels = llama_kernels::cuda_table,
                                     .data = remat::runtime::text_corpus,
                                     .default_data_dir = "/usr/share/games/fortunes",
                                     .default_batch = llama::default_batch,
                                     .default_max_steps = 1500,
                                     .default_learning_rate = 2e-3,
                                     .default_warmup_steps = 100,
                                     .default_eval_samples = 256,
                                     .default_eval_steps = 250,
                                     .sample_length = 400});
}
