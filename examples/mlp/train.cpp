// Trains the residual MLP of mlp.cppm on Fashion-MNIST with the shared remat trainer.
import remat.runtime;
import mlp;
import mlp.kernels;

int main(int argc, char **argv) {
  return remat::runtime::train_main(argc, argv,
                                    {.name = "mlp",
                                     .model = mlp::model,
                                     .default_policy = mlp::policy,
                                     .kernels = mlp_kernels::table,
                                     .cuda_kernels = mlp_kernels::cuda_table,
                                     .data = remat::runtime::fashion_mnist,
                                     .default_data_dir = "/usr/share/datasets/fashion-mnist",
                                     .default_batch = mlp::default_batch,
                                     .default_epochs = 6,
                                     .default_learning_rate = 2e-3,
                                     .default_warmup_steps = 200});
}
